"""Wear: what a chat workload makes the drive write, with bladed and with FlexLLMGen's mmap offload
(``tools/bench_wear.py``, issue 39).

A chat workload at the KV store's interface (no model: what matters here is what is written and when):
``sessions`` conversations, started ``stagger_s`` apart, each ``turns`` turns ``gap_s`` apart (the user reading
and typing); a turn writes its prompt's KV (``prompt_tokens`` rows into every KPU) and then ``reply_tokens``
one-token appends at ``tokens_per_s``. The KV geometry is a real model's (SmolLM2-135M in float32 at batch 1:
30 layers, 3 KV heads of 64: 768-byte rows) sized for the whole conversation. The process that owns the KV
(bladed's daemon; the mmap side's owner processes) runs in a memory cgroup whose limit holds only the first
sessions' KV, so the later ones are above the budget (bladed spills them to the direct path; the page cache
reclaims under the mmap side).

Each side keeps its files on an ext4 filesystem of its own, on a loop device of its own: the device's written
sectors (``/sys/block/loopN/stat``) are exactly what that side made the drive write, the kernel's writeback and
the filesystem's journal included. After the last session closes, the filesystem is synced and read once more.

Sides: ``bladed`` (the daemon's defaults: Dual-Blade's Group 1 in memory files), ``bladed-disk``
(``pagecache.backing = "disk"``: Group 1 in page-cache files on disk, bladed before issue 39), ``mmap``
(FlexLLMGen's ``TorchDisk``: a ``.npy`` memmap per KPU). Per side: the KV bytes the workload produced, per path
(the daemon's op replies), the device bytes written, their ratio, and for bladed what its own commands wrote
(its direct path, demotions included: the daemon's stats) so that the page-cache path's share is the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bladed.io.diskstats import BlockStat, block_stat_of
from bladed.residency.geometry import Geometry
from bladed.torchdisk import OP_WRITE, TorchDiskClient
from bladed_bench import environment, trials
from bladed_bench.cgroup import MemCgroup
from bladed_bench.repo import repo_env
from bladed_bench.workload import BenchDaemon

SCHEMA = "bladed.bench_wear/1"
MiB = 1 << 20
SIDES = ("bladed", "bladed-disk", "mmap")
_LOSETUP = threading.Lock()


@dataclass(frozen=True)
class ChatSpec:
    """The chat workload (module doc)."""

    sessions: int = 4
    turns: int = 5
    gap_s: float = 60.0
    stagger_s: float = 15.0
    prompt_tokens: int = 200
    reply_tokens: int = 100
    tokens_per_s: float = 20.0
    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64
    dtype_bytes: int = 4
    #: the KV owner's memory cgroup: its own memory plus this many sessions' KV
    sessions_in_memory: float = 2.0
    #: bladed's page-cache budget (budget.override) instead of Eq. 1-2's under the cgroup (for a tiny test run,
    #: where the owner's own memory dwarfs the KV)
    pagecache_budget: int | None = None

    @property
    def max_tokens(self) -> int:
        return self.turns * (self.prompt_tokens + self.reply_tokens)

    def geometry(self) -> Geometry:
        return Geometry(layers=self.layers, batch=1, kv_heads=self.kv_heads, head_dim=self.head_dim,
                        dtype_bytes=self.dtype_bytes, max_tokens=self.max_tokens)

    @property
    def session_seconds(self) -> float:
        return (self.turns - 1) * self.gap_s + self.turns * self.reply_tokens / self.tokens_per_s


# -- the device of a side -----------------------------------------------------------------------------

@contextlib.contextmanager
def loop_filesystem(workdir: str, size: int) -> Iterator[tuple[str, BlockStat]]:
    """ext4 on a loop device of its own over a file in ``workdir``, mounted: (mount point, the loop device's
    counters)."""
    img, mnt = os.path.join(workdir, "fs.img"), os.path.join(workdir, "mnt")
    os.makedirs(mnt, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(size)
    with _LOSETUP:         # sides set up at once must not race for the same free loop device
        dev = subprocess.run(["losetup", "--find", "--show", img], check=True, capture_output=True,
                             text=True).stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev], check=True,
                       capture_output=True)
        subprocess.run(["mount", "-t", "ext4", dev, mnt], check=True, capture_output=True)
        try:
            counters = block_stat_of(dev)
            if isinstance(counters, str):
                raise RuntimeError(counters)
            yield mnt, counters
        finally:
            subprocess.run(["umount", mnt], check=False, capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(img)


# -- one conversation -------------------------------------------------------------------------------------

@dataclass
class Tally:
    """What a side's sessions wrote, by path (thread-safe)."""

    by_path: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path: str, nbytes: int) -> None:
        with self.lock:
            self.by_path[path] = self.by_path.get(path, 0) + nbytes


class KVWriter:
    """What a conversation needs of a KV store: slots and token-range writes of every layer at once."""

    channels = 2
    slot: Callable[[int], memoryview]

    def write_tokens(self, start: int, n: int) -> list[tuple[str, int]]:
        """Write tokens ``[start, start + n)`` of every KPU (K on channel 0, V on 1): [(path, bytes)]."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class BladedWriter(KVWriter):
    def __init__(self, socket_path: str, geometry: Geometry) -> None:
        from bladed.client import Client

        self.client = Client(socket_path, timeout=600.0, name="bladed-bench-wear")
        self.session = self.client.open_session(geometry.to_dict(), mode="dualblade", channels=2)
        self.layers = geometry.layers
        self.slot = self.session.slot

    def write_tokens(self, start: int, n: int) -> list[tuple[str, int]]:
        out = []
        for layer in range(self.layers):            # a layer at a time, as a runner writes (one slot's rows)
            for ch, kind in enumerate("kv"):
                (r,) = self.session.submit(ch, [self.session.range("write", layer, kind, start, n)])
                out.append((r.path, r.nbytes))
        return out

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            self.client.close()


class MmapWriter(KVWriter):
    def __init__(self, directory: str, geometry: Geometry, launcher: Callable[[list[str]], list[str]] | None):
        self.owner = TorchDiskClient(launcher, env=repo_env()).open(directory, geometry, 2)
        self.layers = geometry.layers
        self.slot = self.owner.slot

    def write_tokens(self, start: int, n: int) -> list[tuple[str, int]]:
        out = []
        for ch, kind in enumerate("kv"):
            for layer in range(self.layers):
                nbytes, _, _ = self.owner.io(OP_WRITE, layer, kind, ch, start, n)
                out.append(("mmap", nbytes))
        return out

    def close(self) -> None:
        self.owner.close()


def conversation(spec: ChatSpec, writer: KVWriter, tally: Tally, stop: threading.Event) -> None:
    """One chat session: ``turns`` turns of a prompt's KV and a reply's one-token appends, ``gap_s`` apart."""
    g = spec.geometry()
    pos = 0
    rows = os.urandom(g.kpu_bytes)
    for ch in range(writer.channels):
        writer.slot(ch)[:] = rows
    try:
        for turn in range(spec.turns):
            if turn and stop.wait(spec.gap_s):
                return
            for path, nbytes in writer.write_tokens(pos, spec.prompt_tokens):
                tally.add(path, nbytes)
            pos += spec.prompt_tokens
            t_next = time.monotonic()
            for _ in range(spec.reply_tokens):
                for path, nbytes in writer.write_tokens(pos, 1):
                    tally.add(path, nbytes)
                pos += 1
                t_next += 1.0 / spec.tokens_per_s
                if stop.wait(max(0.0, t_next - time.monotonic())):
                    return
    except Exception as e:  # one session's failure is recorded, the others go on
        with tally.lock:
            tally.errors.append(f"{type(e).__name__}: {e}")
    finally:
        writer.close()


def run_side(side: str, spec: ChatSpec, workdir: str, say: Callable[[str], None]) -> dict[str, Any]:
    """One side's whole workload on a filesystem of its own; its record."""
    g = spec.geometry()
    kv_session = 2 * g.layers * g.kpu_bytes
    side_dir = os.path.join(workdir, side)
    shutil.rmtree(side_dir, ignore_errors=True)
    os.makedirs(side_dir)
    rec: dict[str, Any] = {"side": side, "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    fs_bytes = align_up_mib(4 * spec.sessions * kv_session + 256 * MiB)
    with loop_filesystem(side_dir, fs_bytes) as (mnt, device):
        # the owner's own memory (interpreter, libraries, staging slots) and room for this many sessions' KV
        limit = 96 * MiB + 2 * spec.sessions * g.kpu_bytes + int(spec.sessions_in_memory * kv_session)
        cg = MemCgroup(limit, prefix="bladed-wear") if os.geteuid() == 0 else None
        daemon: BenchDaemon | None = None
        tally = Tally()
        stop = threading.Event()
        try:
            launcher = cg.launcher if cg is not None else None
            if side.startswith("bladed"):
                extra: dict[str, dict[str, Any]] = {"budget": {"interval_s": 5.0}}
                if spec.pagecache_budget is not None:
                    extra["budget"]["override"] = spec.pagecache_budget
                if side == "bladed-disk":
                    extra["pagecache"] = {"backing": "disk"}
                daemon = BenchDaemon(os.path.join(mnt, "state"), align_up_mib(spec.sessions * kv_session + 64 * MiB),
                                     launcher, extra)
            os.sync()
            before = device.written_bytes()
            t0 = time.monotonic()
            threads = []
            for i in range(spec.sessions):
                if i and stop.wait(spec.stagger_s):
                    break
                writer: KVWriter = (BladedWriter(daemon.socket_path, g) if daemon is not None else
                                    MmapWriter(os.path.join(mnt, f"torchdisk-{i}"), g, launcher))
                t = threading.Thread(target=conversation, args=(spec, writer, tally, stop), name=f"chat-{i}")
                t.start()
                threads.append(t)
                say(f"{side}: session {i + 1}/{spec.sessions} started")
            for t in threads:
                t.join()
            rec["workload_s"] = round(time.monotonic() - t0, 1)
            rec["written_before_sync"] = device.written_bytes() - before
            if daemon is not None:
                rec["daemon_stats"] = daemon_stats(daemon.socket_path)
            os.sync()
            rec["device_written_bytes"] = device.written_bytes() - before
            if cg is not None:
                rec["cgroup"] = {"limit_bytes": limit, "peak_bytes": cg.peak(), "failcnt": cg.failcnt(),
                                 "events": cg.events()}
        finally:
            stop.set()
            if daemon is not None:
                daemon.stop()
            if cg is not None:
                cg.remove()
    rec["kv_bytes"] = sum(tally.by_path.values())
    rec["kv_bytes_by_path"] = dict(tally.by_path)
    rec["errors"] = tally.errors
    rec["device_written_per_kv_byte"] = rec["device_written_bytes"] / rec["kv_bytes"] if rec["kv_bytes"] else None
    return rec


def daemon_stats(socket_path: str) -> dict[str, Any]:
    """What the daemon says it wrote (its own commands on the direct path, demotions) and did."""
    from bladed.client import Client

    with Client(socket_path) as c:
        st = c.stats()
    return {k: st.get(k) for k in ("replan", "direct_written_bytes", "direct_written_by_cause", "pagecache",
                                   "direct", "io") if k in st}


def align_up_mib(n: int) -> int:
    return (n + MiB - 1) // MiB * MiB


def side_measures(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON's ``summary``: the issue's measures from the sides' records (one run a side, no statistics)."""
    by = {r["side"]: r for r in doc["runs"] if "error" not in r}
    out: dict[str, Any] = {}
    for side, r in by.items():
        kv_pc = r["kv_bytes_by_path"].get("pagecache", 0)
        kv_direct = r["kv_bytes_by_path"].get("direct", 0)
        own = _own_direct_written(r.get("daemon_stats") or {})
        row: dict[str, Any] = {"kv_bytes": r["kv_bytes"], "device_written_bytes": r["device_written_bytes"],
                               "device_per_kv": r["device_written_per_kv_byte"]}
        if side.startswith("bladed"):
            row["kv_pagecache_bytes"], row["kv_direct_bytes"] = kv_pc, kv_direct
            if own is not None:
                causes = (r.get("daemon_stats") or {}).get("direct_written_by_cause") or {}
                row["bladed_direct_written_bytes"] = own
                row["bladed_direct_written_by_cause"] = causes
                # the direct path's own amplification: what its requests and its extents' moves wrote against the
                # KV bytes sent there (demotions copy page-cache KV: they are the page-cache path's cost, below)
                requests = causes.get("requests", own)
                direct = requests + causes.get("extent_move", 0)
                row["direct_device_per_kv"] = direct / kv_direct if kv_direct else None
                row["direct_requests_per_kv"] = requests / kv_direct if kv_direct else None
                # the page-cache path: the kernel's writeback (the rest of the device's count: the filesystem's
                # journal included) and bladed's demotions of its KV
                row["pagecache_device_bytes"] = max(0, r["device_written_bytes"] - own) + causes.get("demotion", 0)
                row["pagecache_device_per_kv"] = row["pagecache_device_bytes"] / kv_pc if kv_pc else None
                # of it, the KV itself: the demotions' copies (bladed's count); the rest is what else reached the
                # side's device (the filesystem's journal, the daemon's journal and wear ledger, the kernel's
                # writeback of page-cache files)
                row["pagecache_demoted_per_kv"] = causes.get("demotion", 0) / kv_pc if kv_pc else None
        out[side] = row
    if "bladed" in by and "mmap" in by and by["mmap"]["device_written_bytes"]:
        out["bladed/mmap_device_written"] = by["bladed"]["device_written_bytes"] / by["mmap"]["device_written_bytes"]
    return out


def _own_direct_written(stats: dict[str, Any]) -> int | None:
    """Bytes bladed's own commands wrote to the device (the daemon's ``stats``: ``direct_written_bytes``)."""
    v = stats.get("direct_written_bytes")
    return int(v) if isinstance(v, int) else None


def run_wear(spec: ChatSpec, sides: list[str], workdir: str, out_path: str | None,
             say: Callable[[str], None] = lambda _m: None, *, parallel: bool = False) -> dict[str, Any]:
    """The workload on every side (one after the other, or all at once with ``parallel``); the JSON doc."""
    os.makedirs(workdir, exist_ok=True)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": trials.machine(None, ("bladed", "cffi_build", "bench", "tools")),
        "workload": dataclasses.asdict(spec) | {"max_tokens": spec.max_tokens,
                                                "session_s": spec.session_seconds,
                                                "kv_bytes_per_session": 2 * spec.layers * spec.geometry().kpu_bytes},
        "sides": sides, "runs": [],
        "vm": {n: environment.read_text(f"/proc/sys/vm/{n}") for n in
               ("dirty_expire_centisecs", "dirty_writeback_centisecs", "dirty_background_ratio", "dirty_ratio")},
    }
    doc["parallel"] = parallel
    save_lock = threading.Lock()

    def one(side: str) -> None:
        say(f"{side}: {spec.sessions} sessions of {spec.session_seconds:.0f} s")
        try:
            rec = run_side(side, spec, workdir, say)
        except Exception as e:
            rec = {"side": side, "error": f"{type(e).__name__}: {e}"}
        with save_lock:
            doc["runs"].append(rec)
            if out_path:
                trials.write_json(out_path, doc)

    if parallel:
        # each side on a loop device of its own: what one side makes its device write is not the others'
        threads = [threading.Thread(target=one, args=(side,), name=f"side-{side}") for side in sides]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        doc["runs"].sort(key=lambda r: sides.index(r["side"]))
    else:
        for side in sides:
            one(side)
    doc["summary"] = side_measures(doc)
    if out_path:
        trials.write_json(out_path, doc, newline=True)
    return doc


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    w = doc["workload"]
    lines = [f"Chat workload: {w['sessions']} sessions of {w['session_s']:.0f} s ({w['turns']} turns "
             f"{w['gap_s']:g} s apart: {w['prompt_tokens']} prompt tokens, {w['reply_tokens']} reply tokens at "
             f"{w['tokens_per_s']:g}/s), "
             f"{w['kv_bytes_per_session'] / MiB:.0f} MiB of KV each; the KV owner's cgroup holds "
             f"{w['sessions_in_memory']:g} sessions' KV. Writeback: dirty_expire_centisecs "
             f"{(doc['vm'].get('dirty_expire_centisecs') or '?').strip()}.", "",
             "| side | KV written (MiB) | of it page cache / direct | device written (MiB) | device ÷ KV | "
             "page-cache path: device ÷ its KV | direct path: device ÷ its KV |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for side in doc["sides"]:
        r = s.get(side)
        if r is None:
            lines.append(f"| {side} | failed | | | | | |")
            continue

        def f(v: Any, d: int = 3) -> str:
            return "-" if v is None else f"{v:.{d}f}"

        split = (f"{r.get('kv_pagecache_bytes', 0) / MiB:.0f} / {r.get('kv_direct_bytes', 0) / MiB:.0f}"
                 if side.startswith("bladed") else "all page cache")
        lines.append(f"| {side} | {r['kv_bytes'] / MiB:.0f} | {split} | {r['device_written_bytes'] / MiB:.1f} | "
                     f"{f(r['device_per_kv'])} | {f(r.get('pagecache_device_per_kv'))} | "
                     f"{f(r.get('direct_device_per_kv'))} |")
    if "bladed/mmap_device_written" in s:
        lines += ["", f"Device bytes written, bladed ÷ mmap: {s['bladed/mmap_device_written']:.3f}"]
    return "\n".join(lines)


__all__ = ["SIDES", "ChatSpec", "markdown", "run_side", "run_wear", "side_measures"]
