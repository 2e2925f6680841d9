"""``bladectl``: talk to a running bladed, and prepare the storage it uses.

The root group and what happens to every failure: the daemon commands are in
:mod:`bladed.cli.daemon_commands`, the storage commands (``ns list``, ``ns check``, ``ns setup``)
in :mod:`bladed.cli.ns`, and what they share in :mod:`bladed.cli.common`.  ``bench`` hands its
arguments to the benchmark harness.

The global options (``--socket``, ``-c/--config``, ``--json``, ``--debug``) go before or after
the command.  Every failure is one line (with ``--json``: one ``{"ok": false, "error": ...}``
object on stdout) and one of the exit statuses in :data:`bladed.cli.common.EXIT_STATUSES`.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import click

from bladed import __version__
from bladed.cli import daemon_commands
from bladed.cli.common import (
    EXIT_BUG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STATUSES,
    EXIT_USAGE,
    Failure,
    Group,
    Settings,
    global_options,
)
from bladed.cli.ns import ns
from bladed.cli.storage import StorageError
from bladed.config import SYSTEM_CONFIG, SYSTEM_SOCKET, ConfigError
from bladed.protocol import BladedError


class Bladectl(Group):
    """The root group: turns every failure into one line (or one JSON object) and an exit status."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        opts = Settings()
        try:
            rv = super().main(argv, prog_name or "bladectl", complete_var, False, obj=opts, **extra)
            status = rv if isinstance(rv, int) else EXIT_OK
        except SystemExit:
            raise  # the bench harness's own exit
        except BaseException as e:  # every failure ends here, reported once
            status = report(e, opts, argv)
        if standalone_mode:
            sys.exit(status)
        return status


def _head(argv: list[str]) -> list[str]:
    """The arguments bladectl parses itself: not those after ``--`` or handed to ``bench``."""
    for i, a in enumerate(argv):
        if a in ("--", "bench"):
            return argv[:i]
    return argv


def _one_line(text: str) -> str:
    return " ".join(text.split())


def classify(e: BaseException) -> tuple[str, str, int, dict[str, Any]]:
    """(message, code, exit status, extra JSON fields) of a failure."""
    if isinstance(e, Failure):
        return e.message, e.code, e.status, e.extra
    if isinstance(e, click.exceptions.NoArgsIsHelpError):
        return f"Missing command; see `{e.ctx.command_path if e.ctx else 'bladectl'} --help`", "usage", EXIT_USAGE, {}
    if isinstance(e, click.UsageError):
        see = f"; see `{e.ctx.command_path} --help`" if e.ctx else ""
        return e.format_message().rstrip(".") + see, "usage", EXIT_USAGE, {}
    if isinstance(e, click.Abort | KeyboardInterrupt | EOFError):
        if not isinstance(e, click.Abort) or isinstance(e.__cause__, KeyboardInterrupt | EOFError):
            return "interrupted", "interrupted", EXIT_INTERRUPTED, {}
        return "not confirmed: nothing was done (--yes answers yes)", "not_confirmed", EXIT_FAILED, {}
    if isinstance(e, click.ClickException):
        return e.format_message(), "failed", e.exit_code, {}
    if isinstance(e, ConfigError):
        where = f"{e.source}: " if e.source else ""
        return f"{where}{'; '.join(e.problems)}", "config", EXIT_USAGE, {}
    if isinstance(e, StorageError):
        return str(e), e.code, EXIT_USAGE if e.usage else EXIT_FAILED, {}
    if isinstance(e, BladedError):
        return str(e), e.code.value, EXIT_FAILED, {}
    if isinstance(e, OSError):
        what = f"{e.filename}: " if e.filename else ""
        return f"{what}{e.strerror or e} (--debug shows where)", "os_error", EXIT_FAILED, {}
    return (f"internal error: {type(e).__name__}: {e} (a bug in bladectl: --debug shows the traceback; "
            "please report it)", "internal", EXIT_BUG, {})


def report(e: BaseException, opts: Settings, argv: list[str]) -> int:
    """Print the failure ``e`` as one line (stderr) or one JSON object (stdout); its exit status."""
    head = _head(argv)
    message, code, status, extra = classify(e)
    message = _one_line(message)
    if opts.debug or "--debug" in head:
        traceback.print_exception(e, file=sys.stderr)
    if opts.json or "--json" in head:
        click.echo(json.dumps({"ok": False, "error": {"code": code, "message": message}, **extra}))
    elif isinstance(e, click.exceptions.NoArgsIsHelpError) and e.ctx:
        click.echo(e.ctx.get_help())  # `bladectl` or `bladectl ns` alone: what there is to run
    else:
        click.echo(f"bladectl: {message}", err=True)
    return status


def _epilog() -> str:
    codes = "\n".join(f"  {n:<4} {what}" for n, what in EXIT_STATUSES)
    return ("Global options go before or after the command (before `bench`: what follows it goes to the "
            "benchmark harness).\n\n"
            "The socket is the first of: --socket; socket.path of -c FILE; $BLADED_SOCKET; socket.path of "
            f"{SYSTEM_CONFIG} if that exists; ./var/bladed/bladed.sock if that exists (a bladed started in this "
            f"directory without options); {SYSTEM_SOCKET}.\n\n"
            f"\b\nExit status:\n{codes}")


@click.group(name="bladectl", cls=Bladectl, epilog=_epilog(), context_settings={"help_option_names": ["-h", "--help"]})
@global_options
@click.version_option(__version__, prog_name="bladectl")
def cli() -> None:
    """Control and inspect bladed, the dual-path KV-cache daemon, and prepare its storage."""


for _command in (*daemon_commands.COMMANDS, ns):
    cli.add_command(_command)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx: click.Context, args: tuple[str, ...]) -> None:
    """The benchmark suite: `bladectl bench STUDY` for every study (`bladectl bench --help` lists them).

    Everything after `bench` goes to the benchmark harness, a separate package (docs/benchmarks.md).
    """
    try:  # the one import of the harness by the product: it is optional, and never shipped with bladed
        from bladed_bench import main as bench_main
    except ModuleNotFoundError as e:
        if e.name != "bladed_bench":
            raise
        raise Failure(f"the benchmark harness is not installed: in a bladed source checkout, run `{sys.executable} "
                      "-m pip install ./bench` (or tools/bench_kv.py)", "no_bench", EXIT_USAGE) from None
    ctx.exit(bench_main(list(args), prog=ctx.command_path))


def main() -> None:
    cli(prog_name="bladectl")


if __name__ == "__main__":
    main()
