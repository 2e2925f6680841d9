"""What every ``bladectl`` command shares: the exit statuses, :class:`Failure`, the global
options, the command classes and the output helpers.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from bladed.config import format_size, parse_size

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_DAEMON, EXIT_BUG, EXIT_INTERRUPTED = 0, 1, 2, 3, 70, 130
#: every exit status bladectl uses, and what it means (the --help epilog and docs/operations.md)
EXIT_STATUSES = (
    (EXIT_OK, "done (ns check: the storage is usable)"),
    (EXIT_FAILED, "failed: bladed refused the request, the storage is in use or unusable, not confirmed"),
    (EXIT_USAGE, "bad command line: unknown command/option, bad value, no such device, bad config file"),
    (EXIT_NO_DAEMON, "no bladed to talk to: no socket, stale socket, no permission, connection lost"),
    (EXIT_BUG, "a bug in bladectl (--debug shows the traceback)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)


class Failure(click.ClickException):
    """A failure the user can act on: one line, a machine-readable code, an exit status."""

    def __init__(self, message: str, code: str = "failed", status: int = EXIT_FAILED,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        #: the exit status
        self.status = status
        #: more fields for the JSON object (e.g. the checks that failed)
        self.extra = extra or {}


# -- the global options ---------------------------------------------------------------------
@dataclass
class Settings:
    """The global options, from wherever on the command line they were given."""

    socket: str | None = None
    config: str | None = None
    json: bool = False
    debug: bool = False


def settings() -> Settings:
    return click.get_current_context().ensure_object(Settings)


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value not in (None, False) and param.name:
        setattr(ctx.ensure_object(Settings), param.name, value)
    return value


def global_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--socket``, ``-c/--config``, ``--json``, ``--debug`` on the group and on every command."""
    for opt in (
        click.option("--debug", is_flag=True, expose_value=False, callback=_store,
                     help="Show the traceback of a failure."),
        click.option("--json", is_flag=True, expose_value=False, callback=_store,
                     help="Machine-readable JSON on stdout (a failure: {\"ok\": false, \"error\": ...})."),
        click.option("-c", "--config", metavar="PATH", expose_value=False, callback=_store,
                     help="Find the socket in this bladed config file."),
        click.option("--socket", metavar="PATH", expose_value=False, callback=_store,
                     help="bladed's socket (default: the rule at the end of `bladectl --help`)."),
    ):
        f = opt(f)
    return f


# -- the command classes --------------------------------------------------------------------
def _summary(help_text: str | None) -> str | None:
    """The first paragraph of a docstring, whole: click would cut it at the first period."""
    if not help_text:
        return None
    return " ".join(inspect.cleandoc(help_text).split("\n\n")[0].split())


class Command(click.Command):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_help = self.short_help or _summary(self.help)


class Group(click.Group):
    command_class = Command
    group_class = type  # subgroups are Groups too

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_help = self.short_help or _summary(self.help)


# -- output ---------------------------------------------------------------------------------
def emit(data: Any, human: Callable[[Any], None]) -> None:
    """``data`` as JSON with ``--json``, else ``human(data)``."""
    if settings().json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)


def size(n: Any) -> str:
    return format_size(int(n)) if isinstance(n, int | float) and n is not None else str(n)


def kv(rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeType()
