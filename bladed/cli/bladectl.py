"""``bladectl``: talk to a running bladed, and prepare the storage it uses.

Daemon commands (``status``, ``sessions``, ``stats``, ``budget``, ``trim``)
go through the same socket and protocol as the client library.  Storage
commands (``ns list``, ``ns check``, ``ns setup``) work without a daemon.
Every command takes ``--json`` for machine-readable output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import re
import resource
import stat
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from bladed import __version__
from bladed.config import (
    Config,
    ConfigError,
    config_from_dict,
    default_socket_path,
    format_size,
    load_config,
    parse_size,
    region_of,
)
from bladed.config import validate_device as config_device_problems
from bladed.protocol import BladedError

NVME_IOCTL_ADMIN_CMD = 0xC0484E41
NVME_ADMIN_FORMAT_NVM = 0x80
#: struct nvme_passthru_cmd (<linux/nvme_ioctl.h>, 72 bytes)
PASSTHRU = struct.Struct("<BBHIIIQQIIIIIIIIII")


# -- plumbing -----------------------------------------------------------------------------
@dataclass
class Ctx:
    socket: str | None
    config: str | None

    def socket_path(self) -> str:
        if self.socket:
            return self.socket
        if self.config:
            return load_config(self.config).socket_path
        return default_socket_path()

    def call(self, what: Callable[[Any], Any]) -> Any:
        from bladed.client import Client

        try:
            with Client(self.socket_path()) as c:
                return what(c)
        except BladedError as e:
            raise click.ClickException(str(e)) from None
        except ConfigError as e:
            raise click.ClickException(str(e)) from None


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(f)


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)


def size(n: Any) -> str:
    return format_size(int(n)) if isinstance(n, int | float) and n is not None else str(n)


def kv(rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", envvar="BLADED_SOCKET", metavar="PATH",
              help="bladed's socket (default: $BLADED_SOCKET, the socket of --config, of /etc/bladed/bladed.toml, "
                   "or the embedded default).")
@click.option("--config", "config_path", metavar="PATH", help="Read the socket path from this bladed config.")
@click.version_option(__version__, prog_name="bladectl")
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None, config_path: str | None) -> None:
    """Control and inspect bladed, the dual-path KV-cache daemon."""
    ctx.obj = Ctx(socket_path, config_path)


# -- daemon commands --------------------------------------------------------------------------
@cli.command()
@json_option
@click.pass_obj
def status(obj: Ctx, as_json: bool) -> None:
    """Daemon version, device, region, sessions and extents."""
    data = obj.call(lambda c: c.status())

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

    emit(data, as_json, human)


@cli.command()
@json_option
@click.pass_obj
def sessions(obj: Ctx, as_json: bool) -> None:
    """Open sessions (yours only unless you are an admin)."""
    data = obj.call(lambda c: c.sessions())

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

    emit(data, as_json, human)


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
@json_option
@click.option("--watch", "-w", is_flag=True, help="Refresh until interrupted (with --json: one object per line).")
@click.option("--interval", "-n", default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", type=int, default=0, help="Stop after this many refreshes (0: never).")
@click.pass_obj
def stats(obj: Ctx, as_json: bool, watch: bool, interval: float, count: int) -> None:
    """Per-path bytes, ops and latency, page-cache hit ratio, TRIMmed bytes."""
    from bladed.client import Client

    if not watch:
        emit(obj.call(lambda c: c.stats()), as_json, lambda d: _stats_table(d, None))
        return
    prev: dict[str, Any] | None = None
    n = 0
    try:
        with Client(obj.socket_path()) as c:
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
    except BladedError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        return


@cli.command()
@json_option
@click.pass_obj
def budget(obj: Ctx, as_json: bool) -> None:
    """Every term of Eq. 1-2 and what each session was granted."""
    data = obj.call(lambda c: c.budget())

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

    emit(data, as_json, human)


@cli.command()
@json_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def trim(obj: Ctx, as_json: bool, yes: bool) -> None:
    """Deallocate (TRIM) the whole region; refused while any session is open."""
    if not yes:
        click.confirm("TRIM the whole KV region (no session data survives)?", abort=True)
    data = obj.call(lambda c: c.trim())
    emit(data, as_json, lambda d: click.echo(
        f"trimmed {size(d['trimmed_bytes'])} (LBA {d['start_lba']} + {d['blocks']}) in {d['seconds'] * 1e3:.1f} ms"))


# -- storage commands --------------------------------------------------------------------------
@cli.group()
def ns() -> None:
    """NVMe namespaces, partitions and files bladed can use."""


@ns.command("list")
@json_option
@click.option("--no-identify", is_flag=True, help="Use sysfs only; never open a device.")
def ns_list(as_json: bool, no_identify: bool) -> None:
    """NVMe controllers, namespaces, char devices, LBA formats, MDTS, capacity."""
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

    emit(data, as_json, human)


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


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "detail": self.detail}


def detect_backend(path: str) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "file"
    if stat.S_ISCHR(st.st_mode):
        return "nvme"
    if stat.S_ISBLK(st.st_mode):
        return "block"
    return "file"


def _kernel() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def run_checks(path: str, backend: str, *, size_bytes: int = 0, region_start: int = 0,
               region_blocks: int = 0) -> list[Check]:
    """Can bladed use ``path`` as ``backend``?  Non-destructive: opens it and reads one block."""
    from bladed.io import Engine, StagingBuffer, open_device

    out: list[Check] = []
    kernel = _kernel()
    need = {"nvme": (5, 19), "block": (5, 1), "file": (5, 1)}[backend]
    out.append(Check("kernel", "ok" if kernel >= need else "fail",
                     f"{platform.release()}; the {backend} backend needs {need[0]}.{need[1]}+"
                     + (" (io_uring_cmd passthrough)" if backend == "nvme" else " (io_uring)")))
    if backend == "nvme":
        out.append(Check("fixed buffers for passthrough", "ok" if kernel >= (6, 1) else "warn",
                         "registered staging buffers with io_uring_cmd need 6.1+"))
    if backend == "block":
        out.append(Check("discard command", "ok" if kernel >= (6, 12) else "warn",
                         "io_uring block discard needs 6.12+; older kernels use ioctl(BLKDISCARD)"))
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = int(f.read().strip())
    except (OSError, ValueError):
        disabled = 0
    out.append(Check("io_uring enabled", {0: "ok", 1: "warn"}.get(disabled, "fail"),
                     f"kernel.io_uring_disabled = {disabled}"
                     + (" (only root or io_uring_group may use it)" if disabled == 1 else "")))
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    root = os.geteuid() == 0
    out.append(Check("memlock", "ok" if root or soft == resource.RLIM_INFINITY or soft >= 64 << 20 else "warn",
                     f"RLIMIT_MEMLOCK {'unlimited' if soft == resource.RLIM_INFINITY else size(soft)}"
                     + ("; running as root (CAP_IPC_LOCK)" if root else
                        "; fixed-buffer registration may fail (LimitMEMLOCK=infinity in the unit)")))
    try:
        from bladed.io.pagecache import cachestat
        probe = os.open("/proc/self/exe", os.O_RDONLY)
        try:
            has_cachestat = cachestat(probe, 0, 4096) is not None
        finally:
            os.close(probe)
    except OSError:
        has_cachestat = False
    out.append(Check("cachestat", "ok" if has_cachestat else "warn",
                     "page-cache hit ratios via cachestat(2)" if has_cachestat else
                     "cachestat(2) missing (kernel < 6.5): hit ratios fall back to mincore(2)"))

    exists = os.path.exists(path)
    if backend == "file" and not exists:
        parent = os.path.dirname(os.path.abspath(path))
        ok = os.path.isdir(parent) and os.access(parent, os.W_OK)
        out.append(Check("exists", "ok" if ok and size_bytes else "fail",
                         f"{path} will be created ({size(size_bytes)})" if ok and size_bytes
                         else f"{path} does not exist" + ("" if ok else f" and {parent} is not writable")
                         + ("" if size_bytes else "; give --size")))
        if not (ok and size_bytes):
            return out
        fd, probe_path = tempfile.mkstemp(dir=parent, prefix=".bladed-probe-")
        os.close(fd)
        try:
            pfd = os.open(probe_path, os.O_RDWR | os.O_DIRECT)
            os.close(pfd)
            out.append(Check("O_DIRECT", "ok", f"the filesystem of {parent} supports O_DIRECT"))
        except OSError as e:
            out.append(Check("O_DIRECT", "fail", f"the filesystem of {parent} refuses O_DIRECT ({e.strerror})"))
        finally:
            os.unlink(probe_path)
        return out
    if not exists:
        out.append(Check("exists", "fail", f"{path} does not exist"))
        return out
    out.append(Check("exists", "ok", f"{path} ({backend})"))
    if not os.access(path, os.R_OK | os.W_OK):
        out.append(Check("permissions", "fail", f"no read-write access to {path} for uid {os.geteuid()}"))
        return out
    opts: dict[str, Any] = {"create": False} if backend == "file" else {}
    try:
        dev = open_device(backend, path, **opts)
    except OSError as e:
        status = "fail"
        why = str(e)
        if e.errno == errno.EBUSY:
            why = f"{path} is in use (mounted, or claimed by another process)"
        out.append(Check("open read-write", status, why))
        return out
    except ValueError as e:
        out.append(Check("open read-write", "fail", str(e)))
        return out
    with dev:
        out.append(Check("permissions", "ok", f"opened {path} read-write"
                         + (" exclusively" if backend == "block" else "")))
        lba = dev.lba_size
        out.append(Check("LBA size", "ok" if lba == 4096 else "warn",
                         f"{lba} bytes" + ("" if lba == 4096 else
                                           "; 4 KiB is what the paper's alignment precondition assumes "
                                           "(bladectl ns setup --format-lba 4096 for NVMe)")))
        cfg = Config()
        cfg.device.region_start_lba, cfg.device.region_blocks = region_start, region_blocks
        problems = config_device_problems(cfg, lba_size=lba, capacity_blocks=dev.capacity_blocks, path=path)
        start, blocks = region_of(cfg, dev.capacity_blocks)
        out.append(Check("region", "fail" if problems or blocks <= 0 else "ok",
                         "; ".join(problems) or f"LBA {start} + {blocks} blocks = {size(blocks * lba)} of "
                                                f"{size(dev.capacity_bytes)}"))
        if backend == "block":
            align = _partition_offset(dev.fd)
            out.append(Check("alignment", "ok" if align % (1 << 20) == 0 else "warn",
                             f"starts at byte {align} of its disk"
                             + ("" if align % (1 << 20) == 0 else ": not 1 MiB aligned")))
            discard = getattr(dev, "discard_max_bytes", 0)
            out.append(Check("discard", "ok" if discard else "warn",
                             f"discard_max_bytes {discard}" + ("" if discard else ": TRIM on teardown is a no-op")))
        if backend == "nvme":
            ident = dev.identity  # type: ignore[attr-defined]
            out.append(Check("MDTS", "ok", f"MDTS {ident.mdts} ({size(ident.mdts_bytes) if ident.mdts else 'no'}"
                                           f" limit); per command {size(dev.max_transfer_bytes)}"))
            out.append(Check("deallocate", "ok" if ident.deallocate_reads_zeroes else "warn",
                             f"DLFEAT {ident.dlfeat & 7}: deallocated blocks read "
                             + ("zeroes" if ident.deallocate_reads_zeroes else "undefined or ones")))
        try:
            buf = StagingBuffer(max(lba, 4096))
            with Engine(dev, 2, [buf]) as eng:
                x = eng.read(start, buf, nbytes=lba)
            buf.close()
            out.append(Check("read", "ok", f"read LBA {start} through io_uring in {x.service_ns / 1e3:.0f} us"))
        except OSError as e:
            out.append(Check("read", "fail", f"reading LBA {start} failed: {e}"))
    return out


def _partition_offset(fd: int) -> int:
    st = os.fstat(fd)
    base = os.path.realpath(f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    try:
        with open(os.path.join(base, "start")) as f:
            return int(f.read().strip()) * 512
    except (OSError, ValueError):
        return 0  # a whole disk


def _print_checks(checks: list[Check], usable: bool, path: str) -> None:
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    for c in checks:
        click.echo(f"[{marks[c.status]}] {c.name}: {c.detail}")
    click.echo(f"{path}: {'usable by bladed' if usable else 'NOT usable by bladed'}")


@ns.command("check")
@json_option
@click.argument("device")
@click.option("--backend", type=click.Choice(["auto", "file", "block", "nvme"]), default="auto", show_default=True)
@click.option("--region-start", type=int, default=0, help="First LBA of the region.")
@click.option("--region-blocks", type=int, default=0, help="Blocks in the region (0: to the end).")
@click.option("--size", "size_text", default="0", help="Store size for a file that does not exist yet.")
def ns_check(device: str, as_json: bool, backend: str, region_start: int, region_blocks: int,
             size_text: str) -> None:
    """Can bladed use DEVICE: LBA size, alignment, permissions, kernel features."""
    kind = detect_backend(device) if backend == "auto" else backend
    checks = run_checks(device, kind, size_bytes=parse_size(size_text), region_start=region_start,
                        region_blocks=region_blocks)
    usable = all(c.status != "fail" for c in checks)
    emit({"device": device, "backend": kind, "usable": usable, "checks": [c.to_dict() for c in checks]},
         as_json, lambda d: _print_checks(checks, usable, device))
    if not usable:
        sys.exit(1)


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
            raise click.ClickException(f"{char_device} offers no {lba_size}-byte LBA format without metadata "
                                       f"(formats: {ident.lba_formats})")
        cdw10 = (index & 0xF) | ((index >> 4) & 0x3) << 12   # LBAF bits 3:0 and LBAFU bits 13:12; SES = 0
        cmd = bytearray(PASSTHRU.pack(NVME_ADMIN_FORMAT_NVM, 0, 0, nsid, 0, 0, 0, 0, 0, 0,
                                      cdw10, 0, 0, 0, 0, 0, 600_000, 0))
        ret = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd, True)
        if ret != 0:
            raise click.ClickException(f"Format NVM of {char_device} failed with NVMe status 0x{ret:x}")
        return index
    finally:
        os.close(fd)


@ns.command("setup")
@json_option
@click.argument("target")
@click.option("--backend", type=click.Choice(["auto", "file", "block", "nvme"]), default="auto", show_default=True)
@click.option("--size", "size_text", default="0", help="File backend: size of the store file (e.g. 64G).")
@click.option("--region-start", type=int, default=0, show_default=True)
@click.option("--region-blocks", type=int, default=0, help="0: to the end of the device.")
@click.option("--state-dir", default="/var/lib/bladed", show_default=True)
@click.option("--socket-path", default="/run/bladed/bladed.sock", show_default=True)
@click.option("--pagecache-dir", default="pagecache", show_default=True, help="Relative to --state-dir.")
@click.option("--format-lba", type=click.Choice(["512", "4096"]), default=None,
              help="NVMe only: reformat the namespace to this LBA size first (erases it; asks to confirm).")
@click.option("--yes", "-y", is_flag=True, help="Confirm --format-lba without asking.")
@click.option("--output", "-o", default="/etc/bladed/bladed.toml", show_default=True,
              help="Where to write the config ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing config file.")
def ns_setup(target: str, as_json: bool, backend: str, size_text: str, region_start: int, region_blocks: int,
             state_dir: str, socket_path: str, pagecache_dir: str, format_lba: str | None, yes: bool,
             output: str, force: bool) -> None:
    """Write (and validate) a bladed config for a namespace, partition or file."""
    kind = detect_backend(target) if backend == "auto" else backend
    store_size = parse_size(size_text)
    formatted = None
    if format_lba:
        if kind != "nvme":
            raise click.ClickException("--format-lba only applies to an NVMe namespace (/dev/ngXnY)")
        if not yes:
            click.confirm(f"Format {target} to {format_lba}-byte LBAs? EVERY BYTE ON IT IS LOST", abort=True)
        formatted = format_namespace(target, int(format_lba))
    checks = run_checks(target, kind, size_bytes=store_size, region_start=region_start, region_blocks=region_blocks)
    if any(c.status == "fail" for c in checks):
        _print_checks(checks, False, target)
        raise click.ClickException(f"{target} cannot be used; nothing written")
    device: dict[str, Any] = {"backend": kind, "path": os.path.abspath(target) if kind == "file" else target,
                              "region_start_lba": region_start, "region_blocks": region_blocks}
    if kind == "file":
        device["size"] = store_size
    lba = next((int(c.detail.split()[0]) for c in checks if c.name == "LBA size"), 0)
    if kind != "file" and lba:
        device["lba_size"] = lba  # the daemon refuses to start if the device changes under it
    try:
        cfg = config_from_dict({"daemon": {"state_dir": state_dir}, "device": device,
                                "pagecache": {"directory": pagecache_dir}, "socket": {"path": socket_path}},
                               source=output)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    text = f"# written by bladectl ns setup on {time.strftime('%Y-%m-%d %H:%M:%S')}\n" + cfg.to_toml()
    if output == "-":
        click.echo(text, nl=False)
    else:
        if os.path.exists(output) and not force:
            raise click.ClickException(f"{output} exists; use --force to overwrite it")
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            f.write(text)
        load_config(output)  # what the daemon will read back
    dropin = ""
    if kind != "file":
        dropin = f"[Service]\nDeviceAllow={os.path.realpath(target)} rw\n"
    result = {"config": output, "backend": kind, "device": device, "formatted_lba_format": formatted,
              "systemd_dropin": dropin, "checks": [c.to_dict() for c in checks]}

    def human(d: dict[str, Any]) -> None:
        click.echo(f"wrote {output}: {kind} {target}, region LBA {region_start} + {region_blocks or 'rest'}; "
                   f"start bladed with --config {output}")
        if dropin:
            click.echo("add to /etc/systemd/system/bladed.service.d/device.conf:\n" + dropin)

    if output != "-":
        emit(result, as_json, human)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """The KV benchmark suite (sweep / run / report): `bladectl bench --help`."""
    from bladed.bench import main as bench_main

    sys.exit(bench_main(list(args)))


def main() -> None:
    cli(prog_name="bladectl")


if __name__ == "__main__":
    main()
