"""``bladectl``: talk to a running bladed, and prepare the storage it uses.

Daemon commands (``status``, ``sessions``, ``stats``, ``budget``, ``trim``) go through the
same socket and protocol as the client library, found by :func:`bladed.config.find_socket`.
Storage commands (``ns list``, ``ns check``, ``ns setup``) work without a daemon; the checks
are in :mod:`bladed.cli.storage`.  ``bench`` hands its arguments to the benchmark harness.

The global options (``--socket``, ``-c/--config``, ``--json``, ``--debug``) go before or after
the command.  Every failure is one line (with ``--json``: one ``{"ok": false, "error": ...}``
object on stdout) and one of the exit statuses in :data:`EXIT_STATUSES`.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import click

from bladed import __version__
from bladed.cli.storage import Check, StorageError, in_use, run_checks, target_backend
from bladed.config import (
    SYSTEM_CONFIG,
    SYSTEM_SOCKET,
    ConfigError,
    SocketLocation,
    config_from_dict,
    find_socket,
    format_size,
    load_config,
    parse_size,
)
from bladed.protocol import BladedError, DaemonLostError

NVME_IOCTL_ADMIN_CMD = 0xC0484E41
NVME_ADMIN_FORMAT_NVM = 0x80
#: struct nvme_passthru_cmd (<linux/nvme_ioctl.h>, 72 bytes)
PASSTHRU = struct.Struct("<BBHIIIQQIIIIIIIIII")

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


# -- plumbing -----------------------------------------------------------------------------
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


def where() -> SocketLocation:
    """The socket, by the one rule (:func:`bladed.config.find_socket`)."""
    s = settings()
    try:
        return find_socket(s.socket, config=s.config, given_as="--socket")
    except ConfigError as e:
        problems = "; ".join(e.problems)
        if s.config:
            raise Failure(f"-c {s.config}: {problems}; give -c the config file bladed runs with", "config",
                          EXIT_USAGE) from None
        raise Failure(f"{e.source}: {problems}; fix it (bladed --config {e.source} --check-config), or give "
                      "--socket or BLADED_SOCKET", "config", EXIT_USAGE) from None


def _connect(wait_s: float = 0.0) -> Any:
    """A client of the bladed found by the socket rule, trying for up to ``wait_s`` seconds.

    The rule is applied again at every try: ``./var/bladed/bladed.sock`` counts only once it exists."""
    from bladed.client import Client

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Client(where(), name="bladectl")
        except DaemonLostError as e:
            if time.monotonic() < deadline:
                time.sleep(0.05)     # a daemon just started: its socket appears when it is ready to serve
                continue
            waited = f" (waited {wait_s:g} s)" if wait_s else ""
            raise Failure(f"{e}{waited}", "no_daemon", EXIT_NO_DAEMON) from None
        except BladedError as e:
            raise Failure(str(e), e.code.value, EXIT_NO_DAEMON) from None


@contextlib.contextmanager
def connected(wait_s: float = 0.0) -> Iterator[Any]:
    """A client of the bladed found by the socket rule; BladedErrors become Failures."""
    client = _connect(wait_s)
    with client:
        try:
            yield client
        except DaemonLostError as e:
            raise Failure(str(e), "daemon_lost", EXIT_NO_DAEMON) from None
        except BladedError as e:
            raise Failure(str(e), e.code.value, EXIT_FAILED) from None


def call(what: Callable[[Any], Any], wait_s: float = 0.0) -> Any:
    with connected(wait_s) as c:
        return what(c)


def emit(data: Any, human: Callable[[Any], None]) -> None:
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


# -- daemon commands --------------------------------------------------------------------------
@cli.command()
@global_options
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=0, metavar="SECONDS", show_default=True,
              help="Wait up to SECONDS for bladed to answer (a daemon just started in the background).")
def status(wait_s: float) -> None:
    """Daemon version, device, region, sessions and extents."""
    data = call(lambda c: c.status(), wait_s)

    def human(d: dict[str, Any]) -> None:
        dev, reg, ext = d["device"], d["region"], d["extents"]
        kv([
            ("bladed", f"{d['version']} (protocol {d['protocol']}), pid {d['pid']}, up {d['uptime_s']:.0f} s"),
            ("config", d["config"]),
            ("socket", d["socket"]),
            ("device", f"{dev['kind']} {dev['path']} ({dev['lba_size']}-byte LBAs, {size(dev['capacity_bytes'])})"),
            ("region", f"LBA {reg['start_lba']} + {reg['blocks']} blocks ({size(reg['bytes'])})"),
            ("extents", f"{ext['used_blocks']} blocks used, {ext['free_blocks']} free"),
            ("page cache", d["pagecache_dir"]),
            ("sessions", f"{d['sessions']} open, {d['connections']} connections"),
            ("budget", f"B_pc {size(d['budget'].get('b_pc'))} ({d['budget'].get('cgroup_version')} "
                       f"{d['budget'].get('cgroup') or 'host'})"),
            ("metrics", d["metrics"] or "off"),
        ])

    emit(data, human)


@cli.command()
@global_options
def sessions() -> None:
    """Open sessions (yours only unless you are an admin)."""
    data = call(lambda c: c.sessions())

    def human(rows: list[dict[str, Any]]) -> None:
        if not rows:
            click.echo("no open sessions")
            return
        click.echo(f"{'SESSION':<10} {'UID':>6} {'PID':>8} {'MODE':<11} {'CH':>2} {'LAYERS':>6} {'N1':>4} "
                   f"{'PAGECACHE':>10} {'DIRECT':>10} {'EXTENT':<16} {'OPS':>8}")
        for s in rows:
            ext = f"{s['extent']['start']}+{s['extent']['nblocks']}" if s["extent"] else "-"
            click.echo(f"{s['session']:<10} {s['uid']:>6} {s['pid']:>8} {s['mode']:<11} {s['channels']:>2} "
                       f"{s['geometry']['layers']:>6} {s['n1']:>4} {size(s['pagecache_bytes']):>10} "
                       f"{size(s['direct_bytes']):>10} {ext:<16} {s['ops']:>8}")

    emit(data, human)


def _stats_table(cur: dict[str, Any], prev: dict[str, Any] | None) -> None:
    dt = cur["time"] - prev["time"] if prev else 0.0
    click.echo(f"{'PATH':<10} {'OP':<6} {'OPS':>9} {'BYTES':>11} {'AVG LAT':>10} {'ERR':>5}"
               + (f" {'MB/s':>9} {'ops/s':>8}" if prev else ""))
    for path, ops in cur["io"].items():
        for op, d in ops.items():
            line = (f"{path:<10} {op:<6} {d['ops']:>9} {size(d['bytes']):>11} "
                    f"{d['latency_avg_s'] * 1e3:>8.2f}ms {d['errors']:>5}")
            if prev and dt > 0:
                p = prev["io"][path][op]
                line += f" {(d['bytes'] - p['bytes']) / dt / 1e6:>9.1f} {(d['ops'] - p['ops']) / dt:>8.1f}"
            click.echo(line)
    pc = cur["pagecache"]
    ratio = "n/a" if pc["hit_ratio"] is None else f"{pc['hit_ratio']:.3f}"
    kv([("page-cache hit ratio", f"{ratio} over {size(pc['read_bytes'])} read"),
        ("sessions", f"{cur['sessions']} open ({cur['sessions_opened']} opened, {cur['sessions_closed']} closed, "
                     f"{cur['sessions_reclaimed']} reclaimed after a crash)"),
        ("extents", f"{cur['extents']['used_blocks']} blocks used, {cur['extents']['free_blocks']} free"),
        ("trimmed", size(cur["trimmed_bytes"])),
        ("B_pc", f"{size(cur['budget'].get('b_pc'))} (held by sessions: {size(cur['budget'].get('held'))})")])


@cli.command()
@global_options
@click.option("--watch", "-w", is_flag=True, help="Refresh until interrupted (with --json: one object per line).")
@click.option("--interval", "-n", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--count", type=click.IntRange(min=0), default=0, help="Stop after this many refreshes (0: never).")
def stats(watch: bool, interval: float, count: int) -> None:
    """Bytes, ops and latency per path, the page-cache hit ratio, TRIMmed bytes."""
    if not watch:
        emit(call(lambda c: c.stats()), lambda d: _stats_table(d, None))
        return
    prev: dict[str, Any] | None = None
    n = 0
    as_json = settings().json
    with connected() as c:
        try:
            while True:
                cur = c.stats()
                if as_json:
                    click.echo(json.dumps(cur))
                else:
                    if sys.stdout.isatty():
                        click.clear()
                    click.echo(time.strftime("%H:%M:%S"))
                    _stats_table(cur, prev)
                    click.echo()
                prev = cur
                n += 1
                if count and n >= count:
                    return
                time.sleep(interval)  # the refresh period of a live view, not a synchronisation
        except KeyboardInterrupt:
            return  # the way to leave --watch


@cli.command()
@global_options
def budget() -> None:
    """Every term of the page-cache budget (Eq. 1-2) and what each session was granted."""
    data = call(lambda c: c.budget())

    def human(d: dict[str, Any]) -> None:
        s = d["sample"]
        kv([
            ("M_avail", f"{size(s.get('m_avail'))}  (host MemAvailable)"),
            ("M_max", f"{size(s.get('m_max'))}  ({s.get('m_max_source')})"),
            ("M_anon+shmem", f"{size(s.get('m_anon_shmem'))}  (anon {size(s.get('m_anon'))}, "
                             f"shmem {size(s.get('m_shmem'))})"),
            ("M*", f"{size(s.get('m_star'))}  = min(M_avail, M_max - M_anon+shmem)  [Eq. 1, {s.get('binding')} binds]"),
            ("N_threads x M_pin", f"{s.get('n_threads')} x {size(s.get('m_pin'))}  (staging of open sessions)"),
            ("B_pc", f"{size(s.get('b_pc'))}  = max(0, M* - N_threads x M_pin)  [Eq. 2]"
                     + (f", override {size(d['override_bytes'])}" if d["override_bytes"] is not None else "")
                     + (f", cap {size(d['cap_bytes'])}" if d["cap_bytes"] is not None else "")),
            ("held by sessions", size(d["held_bytes"])),
            ("available", size(d["available_bytes"])),
            ("cgroup", f"{s.get('cgroup_version')} {s.get('cgroup') or 'host'}"),
            ("page cache now", size(s.get("m_file"))),
        ])
        for x in d["sessions"]:
            click.echo(f"session {x['session']}: {x['channels']} x M_pin {size(x['m_pin'])}, B_pc granted "
                       f"{size(x['b_pc'])}, X {size(x['x_bytes'])}, n1 {x['n1']} layers, "
                       f"Group 1 {size(x['group1_bytes'])}")

    emit(data, human)


@cli.command()
@global_options
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def trim(yes: bool) -> None:
    """Deallocate (TRIM) the whole region; refused while any session is open."""
    with connected() as c:
        if not yes:
            click.confirm(f"TRIM the whole KV region of the bladed at {c.socket_path} (no session data survives)?",
                          abort=True, err=True)
        data = c.trim()
    emit(data, lambda d: click.echo(
        f"trimmed {size(d['trimmed_bytes'])} (LBA {d['start_lba']} + {d['blocks']}) in {d['seconds'] * 1e3:.1f} ms"))


# -- storage commands --------------------------------------------------------------------------
@cli.group()
@global_options
def ns() -> None:
    """NVMe namespaces, partitions and files bladed can use: list, check, setup."""


@ns.command("list")
@global_options
@click.option("--no-identify", is_flag=True, help="Use sysfs only; never open a device.")
def ns_list(no_identify: bool) -> None:
    """NVMe controllers and namespaces: char devices, LBA formats, MDTS, capacity."""
    from bladed.io import discovery

    ctrls = discovery.list_controllers(identify=not no_identify)
    listed = {ns.char_device for c in ctrls for ns in c.namespaces}
    orphans = [n for n in discovery.list_namespaces(identify=not no_identify) if n.char_device not in listed]
    formats = {n.char_device: _lba_formats(n.char_device) for c in ctrls for n in c.namespaces}
    formats.update({n.char_device: _lba_formats(n.char_device) for n in orphans})
    data = {"controllers": [dict(discovery.as_dict(c), namespaces=[
        dict(discovery.as_dict(n), lba_formats=formats[n.char_device]) for n in c.namespaces]) for c in ctrls],
        "namespaces_without_controller": [dict(discovery.as_dict(n), lba_formats=formats[n.char_device])
                                          for n in orphans]}

    def human(d: dict[str, Any]) -> None:
        if not d["controllers"] and not d["namespaces_without_controller"]:
            click.echo("no NVMe controllers found (use the block or file backend, or the NVMe VM for tests)")
            return
        for c in d["controllers"]:
            click.echo(f"{c['name']}  {c['model']}  serial {c['serial']}  fw {c['firmware']}  "
                       f"{c['transport']} {c['address']}")
            for n in c["namespaces"]:
                _print_ns(n)
        for n in d["namespaces_without_controller"]:
            _print_ns(n)

    emit(data, human)


def _print_ns(n: dict[str, Any]) -> None:
    mdts = "?" if n["mdts_bytes"] is None else ("unlimited" if n["mdts_bytes"] == 0 else size(n["mdts_bytes"]))
    fmts = ", ".join(f"{'*' if f['current'] else ''}{f['lba_size']}" + (f"+{f['metadata']}m" if f["metadata"] else "")
                     for f in n["lba_formats"]) or "?"
    click.echo(f"  {n['char_device']}  nsid {n['nsid']}  block {n['block_device'] or '-'}  "
               f"LBA {n['lba_size']}  formats [{fmts}]  MDTS {mdts}  capacity {size(n['capacity_bytes'])}")


def _lba_formats(char_device: str) -> list[dict[str, Any]]:
    from bladed.io.nvme import NvmeDevice

    try:
        dev = NvmeDevice(char_device)
    except (OSError, ValueError):
        return []
    ident = dev.identity
    dev.close()
    return [{"index": i, "lba_size": lba, "metadata": ms, "current": i == ident.current_format}
            for i, (lba, ms) in enumerate(ident.lba_formats) if lba]


def free_target(path: str, backend: str, size_bytes: int) -> str:
    """The backend of ``path`` once it is known to be a store bladed may take; StorageError if not."""
    kind = target_backend(path, backend)
    if not os.path.exists(path):
        if not size_bytes:
            raise StorageError(f"{path} does not exist; give --size to have it created (e.g. --size 64G)",
                               "no_size", usage=True)
        return kind
    why = in_use(path, kind)
    if why:
        fix = ("stop that bladed first to set its store up again" if why.startswith("in use by bladed")
               else "give bladed a device nothing else uses (`bladectl ns list`)")
        raise StorageError(f"{path} is {why}; {fix}", "in_use")
    return kind


def _unusable(path: str, checks: list[Check]) -> str:
    failed = [c for c in checks if c.status == "fail"]
    return f"{path} is NOT usable by bladed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)


def _print_checks(checks: list[Check]) -> None:
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    for c in checks:
        click.echo(f"[{marks[c.status]}] {c.name}: {c.detail}")


def _backend_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--backend", type=click.Choice(["auto", "file", "block", "nvme"]), default="auto",
                        show_default=True, help="auto: a char device is nvme, a block device block, else file.")(f)


@ns.command("check")
@global_options
@click.argument("device")
@_backend_option
@click.option("--region-start", type=click.IntRange(min=0), default=0, help="First LBA of the region.")
@click.option("--region-blocks", type=click.IntRange(min=0), default=0, help="Blocks in the region (0: to the end).")
@click.option("--size", "size_bytes", type=SIZE, default="0", help="Store size for a file that does not exist yet.")
def ns_check(device: str, backend: str, region_start: int, region_blocks: int, size_bytes: int) -> None:
    """Can bladed use DEVICE: not in use, LBA size, alignment, permissions, kernel features.

    DEVICE is an NVMe namespace (/dev/ngXnY), a block device or partition, or a store file
    (created by `ns setup` if missing and --size is given).  Exit status 1 if bladed cannot use it.
    """
    kind = free_target(device, backend, size_bytes)
    checks = run_checks(device, kind, size_bytes=size_bytes, region_start=region_start, region_blocks=region_blocks)
    usable = all(c.status != "fail" for c in checks)
    data: dict[str, Any] = {"ok": usable, "device": device, "backend": kind, "usable": usable,
                            "checks": [c.to_dict() for c in checks]}
    if not usable:
        data["error"] = {"code": "unusable", "message": _unusable(device, checks)}

    def human(_: Any) -> None:
        _print_checks(checks)
        click.echo(f"{device}: usable by bladed" if usable else _unusable(device, checks))

    emit(data, human)
    if not usable:
        click.get_current_context().exit(EXIT_FAILED)


def format_namespace(char_device: str, lba_size: int) -> int:
    """NVMe Format NVM to the LBA format of ``lba_size`` bytes without metadata; returns its index.

    Destroys every byte of the namespace.  The kernel revalidates the
    namespace afterwards (the command's effects include an LBA format change).
    """
    from bladed.io.nvme import NvmeDevice

    dev = NvmeDevice(char_device)
    ident, nsid, fd = dev.identity, dev.nsid, os.dup(dev.fd)
    dev.close()
    try:
        index = next((i for i, (lba, ms) in enumerate(ident.lba_formats) if lba == lba_size and ms == 0), None)
        if index is None:
            raise Failure(f"{char_device} offers no {lba_size}-byte LBA format without metadata (formats: "
                          f"{ident.lba_formats}); pick one of those with --format-lba", "no_such_format", EXIT_USAGE)
        cdw10 = (index & 0xF) | ((index >> 4) & 0x3) << 12   # LBAF bits 3:0 and LBAFU bits 13:12; SES = 0
        cmd = bytearray(PASSTHRU.pack(NVME_ADMIN_FORMAT_NVM, 0, 0, nsid, 0, 0, 0, 0, 0, 0,
                                      cdw10, 0, 0, 0, 0, 0, 600_000, 0))
        ret = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd, True)
        if ret != 0:
            raise Failure(f"Format NVM of {char_device} failed with NVMe status 0x{ret:x}", "format_failed")
        return index
    finally:
        os.close(fd)


@ns.command("setup")
@global_options
@click.argument("target")
@_backend_option
@click.option("--size", "size_bytes", type=SIZE, default="0", help="File backend: size of the store file (e.g. 64G).")
@click.option("--region-start", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--region-blocks", type=click.IntRange(min=0), default=0, help="0: to the end of the device.")
@click.option("--state-dir", default="/var/lib/bladed", show_default=True)
@click.option("--socket-path", default=SYSTEM_SOCKET, show_default=True)
@click.option("--pagecache-dir", default="pagecache", show_default=True, help="Relative to --state-dir.")
@click.option("--format-lba", type=click.Choice(["512", "4096"]), default=None,
              help="NVMe only: reformat the namespace to this LBA size first (erases it; asks to confirm).")
@click.option("--yes", "-y", is_flag=True, help="Confirm --format-lba without asking.")
@click.option("--output", "-o", default=SYSTEM_CONFIG, show_default=True,
              help="Where to write the config ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing config file.")
def ns_setup(target: str, backend: str, size_bytes: int, region_start: int, region_blocks: int,
             state_dir: str, socket_path: str, pagecache_dir: str, format_lba: str | None, yes: bool,
             output: str, force: bool) -> None:
    """Write (and validate) a bladed config for a namespace, partition or file.

    Runs the checks of `ns check` first and writes nothing if TARGET is in use or unusable.
    """
    kind = free_target(target, backend, size_bytes)
    if output != "-" and os.path.exists(output) and not force:
        raise Failure(f"{output} exists; add --force to overwrite it", "exists")
    formatted = None
    if format_lba:
        if kind != "nvme":
            raise Failure(f"--format-lba only applies to an NVMe namespace (/dev/ngXnY); {target} is {kind}",
                          "usage", EXIT_USAGE)
        if not yes:
            click.confirm(f"Format {target} to {format_lba}-byte LBAs? EVERY BYTE ON IT IS LOST", abort=True, err=True)
        formatted = format_namespace(target, int(format_lba))
    checks = run_checks(target, kind, size_bytes=size_bytes, region_start=region_start, region_blocks=region_blocks)
    if any(c.status == "fail" for c in checks):
        if not settings().json:
            _print_checks(checks)
        raise Failure(_unusable(target, checks) + "; nothing written", "unusable",
                      extra={"checks": [c.to_dict() for c in checks]})
    device: dict[str, Any] = {"backend": kind, "path": os.path.abspath(target) if kind == "file" else target,
                              "region_start_lba": region_start, "region_blocks": region_blocks}
    if kind == "file":
        device["size"] = size_bytes
    lba = next((int(c.detail.split()[0]) for c in checks if c.name == "LBA size"), 0)
    if kind != "file" and lba:
        device["lba_size"] = lba  # the daemon refuses to start if the device changes under it
    cfg = config_from_dict({"daemon": {"state_dir": state_dir}, "device": device,
                            "pagecache": {"directory": pagecache_dir}, "socket": {"path": socket_path}},
                           source=output)
    text = f"# written by bladectl ns setup on {time.strftime('%Y-%m-%d %H:%M:%S')}\n" + cfg.to_toml()
    if output == "-":
        click.echo(text, nl=False)
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            f.write(text)
    except OSError as e:
        raise Failure(f"cannot write {output}: {e.strerror}; run as root or give another -o PATH",
                      "os_error") from None
    load_config(output)  # what the daemon will read back
    dropin = device_dropin(target) if kind != "file" else ""
    result = {"config": output, "backend": kind, "device": device, "formatted_lba_format": formatted,
              "systemd_dropin": dropin, "checks": [c.to_dict() for c in checks]}

    def human(d: dict[str, Any]) -> None:
        click.echo(f"wrote {output}: {kind} {target}, region LBA {region_start} + {region_blocks or 'rest'}; "
                   f"start bladed with --config {output}")
        if os.path.abspath(output) != SYSTEM_CONFIG:
            click.echo(f"clients find its socket with `bladectl -c {output}` or BLADED_SOCKET={cfg.socket_path}")
        if dropin:
            click.echo("write to /etc/systemd/system/bladed.service.d/device.conf (replaces the shipped "
                       "systemd/dropins/nvme-device.conf):\n" + dropin)

    emit(result, human)


def systemd_escape_path(path: str) -> str:
    """``systemd-escape --path``: the unit-name form of a device path (``/dev/bladed/kv`` -> ``dev-bladed-kv``)."""
    parts = [p for p in os.path.normpath(path).split("/") if p]
    out = []
    for part in parts:
        esc = "".join(c if (c.isascii() and (c.isalnum() or c in ":_.")) else f"\\x{ord(c):02x}" for c in part)
        out.append(("\\x2e" + esc[1:]) if esc.startswith(".") else esc)
    return "-".join(out)


def device_dropin(target: str) -> str:
    """The drop-in that lets the hardened unit open ``target`` (the shape of systemd/dropins/nvme-device.conf)."""
    unit = systemd_escape_path(target) + ".device"
    return (f"[Unit]\nBindsTo={unit}\nAfter={unit}\n\n[Service]\nPrivateDevices=no\nDevicePolicy=closed\n"
            f"DeviceAllow=\nDeviceAllow={target} rw\n")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx: click.Context, args: tuple[str, ...]) -> None:
    """The KV benchmark suite: sweep, run or report (`bladectl bench --help`).

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
