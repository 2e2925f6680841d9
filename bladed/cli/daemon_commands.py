"""The ``bladectl`` commands that talk to a running bladed: ``status``, ``sessions``, ``stats``,
``budget``, ``wear``, ``prefixes`` (and ``prefixes evict``), ``trim``.

They go through the same socket and protocol as the client library, found by
:func:`bladed.config.find_socket`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from bladed.cli.common import (
    EXIT_FAILED,
    EXIT_NO_DAEMON,
    EXIT_USAGE,
    Command,
    Failure,
    Group,
    emit,
    global_options,
    kv,
    settings,
    size,
)
from bladed.config import ConfigError, SocketLocation, find_socket
from bladed.protocol import BladedError, DaemonLostError


# -- the connection -------------------------------------------------------------------------
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


# -- the commands ---------------------------------------------------------------------------
@click.command(cls=Command)
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
            ("I/O engine", f"{d['engine']['engine']} ({d['engine']['reason']})"),
            ("region", f"LBA {reg['start_lba']} + {reg['blocks']} blocks ({size(reg['bytes'])})"),
            ("extents", f"{ext['used_blocks']} blocks used, {ext['free_blocks']} free"),
            ("page cache", d["pagecache_dir"]),
            ("sessions", f"{d['sessions']} open, {d['connections']} connections"),
            ("page-cache budget", f"{size(d['budget'].get('pagecache_budget_bytes'))} (B_pc; "
                                  f"{d['budget'].get('cgroup_version')} {d['budget'].get('cgroup') or 'host'})"),
            ("metrics", d["metrics"] or "off"),
        ])

    emit(data, human)


@click.command(cls=Command)
@global_options
def sessions() -> None:
    """Open sessions (yours only unless you are an admin)."""
    data = call(lambda c: c.sessions())

    def human(rows: list[dict[str, Any]]) -> None:
        if not rows:
            click.echo("no open sessions")
            return
        click.echo(f"{'SESSION':<10} {'UID':>6} {'PID':>8} {'MODE':<11} {'KV':<6} {'CH':>2} {'LAYERS':>6} "
                   f"{'G1 LAYERS':>9} {'PAGECACHE':>10} {'DIRECT':>10} {'EXTENT':<16} {'OPS':>8}")
        for s in rows:
            ext = f"{s['extent']['start']}+{s['extent']['nblocks']}" if s["extent"] else "-"
            g = s["geometry"]
            fmt = g.get("kv_format") or f"{g['dtype_bytes']}B"     # unnamed plain rows: the element size
            click.echo(f"{s['session']:<10} {s['uid']:>6} {s['pid']:>8} {s['mode']:<11} {fmt:<6} {s['channels']:>2} "
                       f"{g['layers']:>6} {s['group1_layers']:>9} {size(s['pagecache_bytes']):>10} "
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
        ("page-cache budget", f"{size(cur['budget'].get('pagecache_budget_bytes'))} (B_pc; held by sessions: "
                              f"{size(cur['budget'].get('held_bytes'))})"),
        ("written by bladed", f"{size(cur['direct_written_bytes'])} to the store device since start ("
                              + ", ".join(f"{k} {size(v)}" for k, v in cur["direct_written_by_cause"].items())
                              + ")"),
        *_kernel_rows(cur.get("wear", {}).get("kernel", {}))])


def _kernel_rows(kernel: dict[str, Any]) -> list[tuple[str, str]]:
    """The kernel's count of each role's block device, since the daemon started."""
    rows = []
    for role, k in kernel.items():
        what = "store" if role == "store" else "page-cache directory"
        if k.get("device") is None:
            rows.append((f"{what}'s device", f"unknown: {k.get('why')}"))
        else:
            unseen = "; bladed's NVMe passthrough not counted" if k.get("passthrough_counted") is False else ""
            rows.append((f"{what}'s device", f"{k['device']}: {size(k['written_bytes'])} written since start, all "
                                             f"writers (the kernel's count{unseen})"))
    return rows


@click.command(cls=Command)
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


@click.command(cls=Command)
@global_options
def budget() -> None:
    """Every term of the page-cache budget (Eq. 1-2) and what each session was granted."""
    data = call(lambda c: c.budget())

    def human(d: dict[str, Any]) -> None:
        s = d["sample"]
        kv([
            ("host available (M_avail)", f"{size(s.get('host_available_bytes'))}  (host MemAvailable)"),
            ("memory limit (M_max)", f"{size(s.get('memory_limit_bytes'))}  ({s.get('memory_limit_source')})"),
            ("binding cgroup", f"{s.get('binding_cgroup') or 'none (the host binds)'}"
                               + ("  (a cgroup above bladed's: its other children count)"
                                  if s.get("binding_cgroup") not in (None, "", s.get("cgroup")) else "")),
            ("anon + shmem (M_anon+shmem)", f"{size(s.get('anon_shmem_bytes'))}  of the binding cgroup, bladed's KV in "
                                            f"memory files out (bladed's cgroup: anon {size(s.get('anon_bytes'))}, "
                                            f"shmem {size(s.get('shmem_bytes'))})"),
            ("kernel (M_kernel)", f"{size(s.get('charged_kernel_bytes'))}  (slab, page tables, stacks charged there)"),
            ("mapped, kept (M_mapped)", f"{size(s.get('mapped_bytes'))}  (mapped page cache "
                                        f"{size(s.get('file_mapped_bytes'))} less shmem and bladed's KV "
                                        f"{size(s.get('own_kv_bytes'))}: the processes' code and files)"),
            ("kept free (M_free)", f"{size(s.get('free_bytes'))}  (max of {s.get('headroom')} of M_max and "
                                   f"budget.absorb_rate x 25 ms, where a cgroup limits)"),
            ("usable (M*)", f"{size(s.get('usable_bytes'))}  = min(M_avail, M_max - M_anon+shmem - M_kernel - "
                            f"M_mapped - M_free)  [Eq. 1, {s.get('binding')} binds]"),
            ("staging (M_pin,others)", f"{size(s.get('pinned_elsewhere_bytes'))}  (of the open sessions; "
                                       f"{size(s.get('pinned_uncharged_bytes'))} not yet charged as shmem)"),
            ("page-cache budget (B_pc)", f"{size(s.get('pagecache_budget_bytes'))}  = max(0, M* - uncharged staging) "
                                         f"/ (1 + {s.get('kernel_overhead')})  [Eq. 2]"
             + (f", override {size(d['override_bytes'])}" if d["override_bytes"] is not None else "")
             + (f", cap {size(d['cap_bytes'])}" if d["cap_bytes"] is not None else "")),
            ("held by sessions", size(d["held_bytes"])),
            ("available", size(d["available_bytes"])),
            ("cgroup", f"{s.get('cgroup_version')} {s.get('cgroup') or 'host'}"),
            ("page cache now", size(s.get("file_bytes"))),
        ])
        for x in d["sessions"]:
            click.echo(f"session {x['session']}: {x['channels']} x M_pin {size(x['pinned_per_thread_bytes'])}, "
                       f"budget granted {size(x['budget_bytes'])}, Group 1 limit X {size(x['group1_limit_bytes'])}, "
                       f"{x['group1_layers']} whole layers in Group 1 ({size(x['group1_bytes'])})")

    emit(data, human)


def _days(x: Any) -> str:
    return "unknown" if x is None else f"{x:,.0f} days" if x >= 10 else f"{x:.1f} days"


def _wear_report(d: dict[str, Any]) -> None:
    """``bladectl wear`` for people."""
    def causes(f: dict[str, Any]) -> str:
        parts = [f"{k} {size(v)}" for k, v in f["direct"].items() if v]
        return f"{size(f['direct_bytes'])}" + (f" ({', '.join(parts)})" if parts else "")

    budget = d["write_budget"]
    left = int(d["day_ends"] - d["time"])
    rows = [
        ("device", f"{d['backend']} {d['device']}"),
        ("written by bladed today", f"{causes(d['today'])}  [UTC day {d['day']}, ends in {left // 3600} h "
                                    f"{left % 3600 // 60:02d} min]"),
        ("written by bladed since install", f"{causes(d['since_install'])}  [since {_when(d['installed'])}]"),
        ("write budget (io.write_budget)",
         "off" if not budget["bytes"] else
         f"{size(budget['spent_bytes'])} of {size(budget['bytes'])} a day"
         + (": SPENT, new direct-path spills are refused until 00:00 UTC" if budget["exhausted"]
            else f", {size(budget['left_bytes'])} left")
         + (f"; refused: {', '.join(f'{k} {v}' for k, v in budget['refusals'].items() if v)}"
            if any(budget["refusals"].values()) else "")),
    ]
    rows += [(f"  the kernel: {r[0]}", r[1]) for r in _kernel_rows(d["kernel"])]
    s = d["smart"]
    if s is None:
        rows.append(("drive (SMART)", f"unavailable: {d['smart_error']}"))
    else:
        t, e = d["trend"], d["endurance"]
        per30 = t["percentage_used_per_day"]
        rows += [
            ("percentage used", f"{s['percentage_used']} %"
             + (f"  (trend: {per30 * 30:+.2f} points / 30 days over the last {t['days']:.1f} days)"
                if per30 is not None else "  (trend: needs SMART readings an hour apart)")),
            ("available spare", f"{s['available_spare']} % (threshold {s['available_spare_threshold']} %)"),
            ("data written / read", f"{s['data_units_written']} / {s['data_units_read']} units of 512000 bytes "
                                    f"({size(s['data_written_bytes'])} / {size(s['data_read_bytes'])})"),
            ("host write / read commands", f"{s['host_write_commands']} / {s['host_read_commands']}"),
            ("media errors", str(s["media_errors"])),
            ("critical warning", f"0x{s['critical_warning']:02x}" + ("" if not s["critical_warning"] else "  (!)")),
            ("temperature", f"{s['temperature_celsius']} C ({s['temperature_kelvin']} K)"),
            ("power-on hours", str(s["power_on_hours"])),
        ]
        if e["bytes"] is None:
            rows.append(("days left", f"unknown: {e['why']}"))
        else:
            rate = e["rate_bytes_per_day"]
            basis = {"smart_trend": "the SMART trend", "lifetime_average": "the drive's lifetime average"}
            rows.append(("days left", _days(e["days_left"])
                         + f"  (rated {size(e['bytes'])} from {e['source']}, written {size(e['written_bytes'])}"
                         + (f", at {size(int(rate))}/day by {basis.get(e['rate_basis'], e['rate_basis'])})"
                            if rate else f"; {e['why']})")))
        if e["days_left_by_percentage_used"] is not None:
            rows.append(("days left by percentage used", _days(e["days_left_by_percentage_used"])))
    kv(rows)


@click.command(cls=Command)
@global_options
def wear() -> None:
    """What bladed wrote to the device today and since install, the write budget, the drive's wear and days left.

    Written by bladed: its own commands on the direct path (requests, live demotions, extent moves, retained
    prefixes), from the wear ledger in the state directory. The drive's figures come from its NVMe SMART /
    Health log (nvme backend); on block and file backends the kernel's count of written bytes is all there is.
    """
    emit(call(lambda c: c.wear()), _wear_report)


@click.command(cls=Command)
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


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t))) if t else "-"


def _prefixes_table(d: dict[str, Any]) -> None:
    rows = d["prefixes"]
    click.echo(f"scope {d['scope']}, blocks of {d['block_tokens']} tokens: {len(rows)} retained "
               f"prefix{'es' if len(rows) != 1 else ''}")
    if not rows:
        return
    click.echo(f"{'ENTRY':<14} {'SCOPE':<10} {'TOKENS':>6} {'DTYPE':<8} {'PAGECACHE':>10} {'DEVICE':>10} "
               f"{'HITS':>5} {'IN USE':>6} {'LAST USED':<19} MODEL")
    for e in rows:
        click.echo(f"{e['entry']:<14} {e['scope']:<10} {e['tokens']:>6} {e['dtype']:<8} "
                   f"{size(e['pagecache_bytes']):>10} {size(e['device_bytes']):>10} {e['hits']:>5} "
                   f"{e['in_use']:>6} {_when(e['last_used']):<19} {e['model']}")


@click.group(cls=Group, invoke_without_command=True)
@global_options
@click.pass_context
def prefixes(ctx: click.Context) -> None:
    """Retained prefixes (yours only unless you are an admin): id, tokens, bytes on each path, hits, last use.

    bladed keeps the KV of a prompt's whole token blocks when a client retains it, and copies it into a later
    session whose prompt starts the same (docs/transformers.md, "Prefix reuse"). `prefixes evict` drops some.
    """
    if ctx.invoked_subcommand is None:
        emit(call(lambda c: c.prefixes()), _prefixes_table)


@prefixes.command("evict")
@global_options
@click.argument("entry", required=False)
@click.option("--all", "every", is_flag=True, help="Every retained prefix you may see (all of them for an admin).")
def prefixes_evict(entry: str | None, every: bool) -> None:
    """Evict the retained prefix ENTRY (an id from `bladectl prefixes`), or --all; their storage is freed."""
    if (entry is None) == (not every):
        raise click.UsageError("give one retained prefix ENTRY or --all" if entry is None
                               else "give ENTRY or --all, not both")
    evicted = call(lambda c: c.evict_prefixes(entry))
    emit({"evicted": evicted},
         lambda d: click.echo(f"evicted {len(d['evicted'])} retained prefix{'es' if len(d['evicted']) != 1 else ''}"
                              + (f": {' '.join(d['evicted'])}" if d["evicted"] else "")))


#: the commands, for the root group
COMMANDS = (status, sessions, stats, budget, wear, prefixes, trim)
