"""The arm64 smoke: bladed on its embedded default, KV written, read back and verified, torn down with TRIM.

Run inside the emulated arm64 system (``tools/vm/arm64/run-arm64.sh [--user] -- python tools/vm/arm64/smoke.py``;
tests/test_arm64.py does): it starts ``python -m bladed.server`` with no config and no options in a fresh
directory under /tmp, so the embedded default puts a file-backed store, the page-cache directory and the
socket in ``var/bladed`` there. Then, through the client library (``bladed.client``):

* three sessions: ``direct`` with whole-LBA token rows (every KPU on the store's extent, served by the C
  lane on the channel's ring), ``direct`` with packed rows (768-byte tokens: the extent store's general
  path), ``dualblade`` (the embedded default's budget is the machine's memory: every KPU on the
  page-cache path);
* each KPU written from one channel's staging slot and read back into another's, a token range read
  back in the middle of a KPU, all compared byte for byte; a page-cache KPU read right after its write is
  all resident, so its reply's hit ratio must be 1.0 (measured in the kernel's pages);
* the store file's allocated blocks (``st_blocks``) and its data (``SEEK_DATA``) over each direct
  session's extent before and after the session's close: the teardown TRIM punches holes on the file
  backend, so the blocks are freed and the extent reads as a hole;
* the daemon stopped with SIGTERM (exit status 0);
* with ``--nvme DEV`` (the VM's QEMU NVMe namespace, ``run-arm64.sh --nvme SIZE``): a second daemon on that
  namespace (NVMe passthrough through io_uring_cmd), a direct session as above, its close deallocating the
  extent (``trimmed_bytes``).

It prints one JSON object (the facts; ``failures`` lists what did not hold) and exits 0 when nothing
failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from typing import Any

from bladed.client import Client
from bladed.config import config_from_dict
from bladed.residency import Geometry
from bladed.spawn import PrivateDaemon

#: token = 2*8*128*2 = 4096 bytes: whole-LBA rows; KPU = 64 tokens = 256 KiB
ALIGNED = Geometry(layers=4, batch=2, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=64)
#: token = 3*64*4 = 768 bytes: packed rows on the extent
PACKED = Geometry(layers=3, batch=1, kv_heads=3, head_dim=64, dtype_bytes=4, max_tokens=40)
SESSIONS = [("direct-aligned", ALIGNED, "direct"), ("direct-packed", PACKED, "direct"),
            ("dualblade", ALIGNED, "dualblade")]
READY_TIMEOUT_S = 300.0


def pattern(name: str, layer: int, kind: str, nbytes: int) -> bytes:
    return random.Random(f"{name}/{layer}/{kind}").randbytes(nbytes)


def data_in(path: str, start: int, nbytes: int) -> int:
    """How many bytes of ``[start, start + nbytes)`` of the file lie in allocated data (SEEK_DATA/SEEK_HOLE)."""
    end = start + nbytes
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = start
        while pos < end:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            if pos >= end:
                break
            hole = min(os.lseek(fd, pos, os.SEEK_HOLE), end)
            total += hole - pos
            pos = hole
    finally:
        os.close(fd)
    return total


def event(log_path: str, name: str) -> dict[str, str]:
    """The fields of the last ``event=NAME`` line of the daemon's log ({} if none)."""
    found: dict[str, str] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            if f"event={name} " in line:
                found = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
    return {k: v.strip('"') for k, v in found.items()}


def exercise(c: Client, name: str, geo: Geometry, mode: str, store: str | None, out: dict[str, Any],
             failures: list[str]) -> None:
    """One session: every KPU written, read back and compared, a token range too, then the close; with a file
    ``store``, its data and blocks over the session's extent before and after the close's TRIM."""
    res: dict[str, Any] = {"mode": mode, "kpu_bytes": geo.kpu_bytes, "token_bytes": geo.token_bytes}
    out["sessions"][name] = res
    trimmed0 = c.stats()["trimmed_bytes"]
    t0 = time.monotonic()
    s = c.open_session(geo, mode=mode, channels=2)
    try:
        mine = next(x for x in c.sessions() if x["session"] == s.id)
        ext = mine["extent"]
        lba = int(c.stats()["lba_size"])
        res["extent"] = ext
        paths = []
        bad = []
        hits = set()
        for layer in range(geo.layers):
            for kind in "kv":
                data = pattern(name, layer, kind, geo.kpu_bytes)
                s.slot(0)[:] = data
                paths.append(s.write(layer, kind, 0).path)
                s.slot(1)[:] = bytes(geo.kpu_bytes)
                hits.add(s.read(layer, kind, 1).hit_ratio)
                if bytes(s.slot(1)) != data:
                    bad.append(f"{kind}{layer}")
        # a token range in the middle of the last KPU (Algorithm 2: slba = start + offset / LBA)
        layer, tb = geo.layers - 1, geo.token_bytes
        data = pattern(name, layer, "v", geo.kpu_bytes)
        s.slot(1)[:] = bytes(geo.kpu_bytes)
        r = s.read(layer, "v", 1, token_start=3, ntokens=5)
        got = bytes(s.slot(1))
        range_ok = got[3 * tb:8 * tb] == data[3 * tb:8 * tb] and got[:3 * tb] == bytes(3 * tb) \
            and r.nbytes == 5 * tb
        res.update(paths=sorted(set(paths)), kpus=len(paths), mismatched=bad, range_read_ok=range_ok,
                   hit_ratios=sorted(hits, key=lambda h: -1.0 if h is None else h))
        if mode != "direct" and hits != {1.0}:
            # just written through the page cache, so every page of it is resident: the hit bytes (cachestat,
            # else mincore, counted in the kernel's pages) must be all the bytes read
            failures.append(f"{name}: page-cache reads of KPUs just written report hit ratios {res['hit_ratios']}, "
                            "not 1.0")
        if bad:
            failures.append(f"{name}: KPUs read back different from what was written: {bad}")
        if not range_ok:
            failures.append(f"{name}: the token range 3..8 of v{layer} read back wrong")
        want_path = "direct" if mode == "direct" else "pagecache"
        if set(paths) != {want_path}:
            failures.append(f"{name}: KPUs went on {sorted(set(paths))}, expected only {want_path}")
        if ext is not None and store is not None:
            start, nbytes = ext["start"] * lba, ext["nblocks"] * lba
            res["extent_data_bytes_before_close"] = data_in(store, start, nbytes)
            if res["extent_data_bytes_before_close"] == 0:
                failures.append(f"{name}: the extent holds no data after the writes")
        if store is not None:
            res["store_blocks_before_close"] = os.stat(store).st_blocks
    finally:
        s.close()  # the daemon TRIMs the extent before it answers
    res["seconds"] = round(time.monotonic() - t0, 2)
    res["trimmed_bytes"] = c.stats()["trimmed_bytes"] - trimmed0
    if ext is not None and res["trimmed_bytes"] != ext["nblocks"] * lba:
        failures.append(f"{name}: close TRIMmed {res['trimmed_bytes']} bytes, the extent has {ext['nblocks'] * lba}")
    if store is None:
        return
    res["store_blocks_after_close"] = os.stat(store).st_blocks
    if ext is not None:
        start, nbytes = ext["start"] * lba, ext["nblocks"] * lba
        res["extent_data_bytes_after_close"] = data_in(store, start, nbytes)
        if res["extent_data_bytes_after_close"] != 0:
            failures.append(f"{name}: {res['extent_data_bytes_after_close']} bytes of the extent still allocated "
                            "after the TRIM (SEEK_DATA)")
        if res["store_blocks_after_close"] > out["store_blocks_at_start"]:
            failures.append(f"{name}: the store holds {res['store_blocks_after_close']} blocks after the close, "
                            f"{out['store_blocks_at_start']} at the start")


def nvme_phase(dev: str, out: dict[str, Any], failures: list[str]) -> None:
    """A second daemon on the NVMe namespace ``dev`` (its generic char device: passthrough commands through
    io_uring_cmd), one direct session exercised as above; the close deallocates (TRIMs) its extent."""
    res: dict[str, Any] = {"device": dev, "sessions": {}}
    out["nvme"] = res
    base = tempfile.mkdtemp(prefix="bd-arm64-nvme-", dir="/tmp")
    log_path = os.path.join(base, "daemon.log")
    with open(os.path.join(base, "bladed.toml"), "w") as f:
        f.write(config_from_dict({"device": {"backend": "nvme", "path": dev}}, state_dir=base).to_toml())
    daemon = PrivateDaemon(["--config", os.path.join(base, "bladed.toml"), "--state-dir", base],
                           log_path=log_path).start()
    try:
        daemon.wait_ready(READY_TIMEOUT_S)
        start = event(log_path, "daemon_start")
        res.update(engine=start.get("engine"), backend=start.get("backend"))
        with Client(os.path.join(base, "bladed.sock")) as c:
            exercise(c, "nvme-direct", ALIGNED, "direct", None, res, failures)
    except Exception as e:
        failures.append(f"nvme: {type(e).__name__}: {e}")
    finally:
        res["daemon_rc"] = daemon.stop(60)
        if failures:
            res["daemon_log_tail"] = daemon.log_tail(15)
    if res["daemon_rc"] != 0:
        failures.append(f"nvme: the daemon exited with status {res['daemon_rc']} on SIGTERM")
    shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme", metavar="DEV", help="also run a daemon on this NVMe namespace (e.g. /dev/ng0n1)")
    args = parser.parse_args()
    failures: list[str] = []
    out: dict[str, Any] = {
        "machine": platform.machine(), "kernel": platform.release(), "page_size": os.sysconf("SC_PAGE_SIZE"),
        "python": platform.python_version(), "emulation": os.environ.get("BLADED_ARM64", ""), "sessions": {},
        "failures": failures,
    }
    base = tempfile.mkdtemp(prefix="bd-arm64-", dir="/tmp")  # short: Unix socket paths are limited
    state = os.path.join(base, "var", "bladed")
    log_path = os.path.join(base, "daemon.log")
    t0 = time.monotonic()
    daemon = PrivateDaemon([], cwd=base, log_path=log_path).start()
    try:
        daemon.wait_ready(READY_TIMEOUT_S)
        out["daemon_ready_s"] = round(time.monotonic() - t0, 2)
        start = event(log_path, "daemon_start")
        out.update(engine=start.get("engine"), backend=start.get("backend"), config=start.get("config"))
        store = start.get("device", os.path.join(state, "kv-store.img"))
        out["store_blocks_at_start"] = os.stat(store).st_blocks
        with Client(os.path.join(state, "bladed.sock")) as c:
            for name, geo, mode in SESSIONS:
                exercise(c, name, geo, mode, store, out, failures)
            st = c.stats()
            out["stats"] = {k: st[k] for k in ("engine", "sessions", "sessions_opened", "sessions_closed",
                                               "trimmed_bytes", "integrity_errors", "bad_requests")}
            out["stats"]["used_blocks"] = st["extents"]["used_blocks"]
            if st["sessions"] != 0 or st["extents"]["used_blocks"] != 0:
                failures.append(f"sessions or extent blocks left after the closes: {out['stats']}")
        pc = os.path.join(state, "pagecache")
        out["pagecache_files_left"] = sorted(os.listdir(pc)) if os.path.isdir(pc) else []
        if out["pagecache_files_left"]:
            failures.append(f"page-cache files left: {out['pagecache_files_left']}")
        out["store_blocks_at_end"] = os.stat(store).st_blocks
    except Exception as e:
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        out["daemon_rc"] = daemon.stop(60)
        out["daemon_log_tail"] = daemon.log_tail(15)
        out["seconds"] = round(time.monotonic() - t0, 2)
    if out["daemon_rc"] != 0:
        failures.append(f"the daemon exited with status {out['daemon_rc']} on SIGTERM")
    if args.nvme:
        nvme_phase(args.nvme, out, failures)
    if out["machine"] != "aarch64":
        failures.append(f"not on aarch64 but {out['machine']}")
    out["state_dir"] = base
    if not failures:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out, indent=1), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
