"""Soak: 8 concurrent sessions of random geometries and modes write, read
back and close, over and over, with checksummed sessions (crc32c per token
row, verified by the daemon) and every read also compared byte for byte by
the client.  Zero mismatches; throughput and latency p99 are printed (and
recorded in docs/reliability.md from ``tests/reliability.py soak``).

CI runs 20 s (``BLADED_SOAK_S``); the long run is ``tests/reliability.py soak
--seconds 600``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from daemon_util import DaemonProcess, short_tmpdir

from bladed.client import Client

SOAK_S = float(os.environ.get("BLADED_SOAK_S", "20"))
SESSIONS = 8
SOAK_CONFIG = {"device": {"size": "512M"}, "budget": {"override": 8 << 20}, "io": {"checksums": True}}


def random_geometry(rng: random.Random) -> dict[str, int]:
    return {"layers": rng.randint(1, 6), "batch": rng.choice([1, 2]), "kv_heads": rng.choice([1, 2, 3, 4, 8]),
            "head_dim": rng.choice([32, 64, 128]), "dtype_bytes": rng.choice([1, 2, 4]),
            "max_tokens": rng.choice([8, 16, 33, 64, 128])}


def worker(path: str, seed: int, until: float, out: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    lat: list[float] = []
    nbytes = verified = sessions = 0
    mismatches = []
    with Client(path, timeout=120) as c:
        while time.monotonic() < until:
            geo = random_geometry(rng)
            tb = geo["batch"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"]
            T = geo["max_tokens"]
            with c.open_session(geo, mode=rng.choice(["dualblade", "direct", "baseline", "cachepolicy"]),
                                channels=rng.choice([1, 2]), checksums=True) as s:
                sessions += 1
                truth: dict[tuple[int, str], bytearray] = {}
                for _ in range(rng.randint(4, 24)):
                    layer, kind = rng.randrange(geo["layers"]), rng.choice("kv")
                    ch = rng.randrange(s.channels)
                    start = rng.randrange(T)
                    n = rng.randint(1, T - start)
                    key = (layer, kind)
                    if key not in truth or rng.random() < 0.5:
                        data = rng.randbytes(n * tb)
                        s.slot(ch)[start * tb:(start + n) * tb] = data
                        t0 = time.perf_counter()
                        s.write(layer, kind, ch, start, n)
                        lat.append(time.perf_counter() - t0)
                        buf = truth.setdefault(key, bytearray(T * tb))
                        buf[start * tb:(start + n) * tb] = data
                    else:
                        s.slot(ch)[start * tb:(start + n) * tb] = b"\x5c" * (n * tb)
                        t0 = time.perf_counter()
                        s.read(layer, kind, ch, start, n)
                        lat.append(time.perf_counter() - t0)
                        got = bytes(s.slot(ch)[start * tb:(start + n) * tb])
                        if got != bytes(truth[key][start * tb:(start + n) * tb]):
                            mismatches.append((seed, geo, layer, kind, start, n))
                        verified += n * tb
                    nbytes += n * tb
    with lock:
        out["lat"].extend(lat)
        out["bytes"] += nbytes
        out["verified"] += verified
        out["sessions"] += sessions
        out["mismatches"].extend(mismatches)


def run_soak(path: str, seconds: float, seed: int = 0, sessions: int = SESSIONS) -> dict:
    out: dict = {"lat": [], "bytes": 0, "verified": 0, "sessions": 0, "mismatches": []}
    lock = threading.Lock()
    errors: list[BaseException] = []
    until = time.monotonic() + seconds

    def run(i: int) -> None:
        try:
            worker(path, seed * 1000 + i, until, out, lock)
        except BaseException as e:
            errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.monotonic() - t0
    if errors:
        raise errors[0]
    lat = np.array(out["lat"]) * 1e3
    return {"seconds": secs, "sessions_opened": out["sessions"], "ops": len(lat), "bytes": out["bytes"],
            "bytes_verified": out["verified"], "mismatches": out["mismatches"],
            "throughput_mib_s": out["bytes"] / secs / 2**20, "ops_s": len(lat) / secs,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp, DaemonProcess(tmp, SOAK_CONFIG).start() as d:
        yield d


@pytest.mark.slow
def test_soak_8_sessions_checksummed_zero_mismatches(daemon: DaemonProcess) -> None:
    res = run_soak(daemon.socket_path, SOAK_S)
    print(f"\nsoak {res['seconds']:.0f} s: {res['sessions_opened']} sessions, {res['ops']} ops, "
          f"{res['throughput_mib_s']:.1f} MiB/s, p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms, "
          f"{res['bytes_verified']} bytes verified")
    assert res["mismatches"] == []
    with Client(daemon.socket_path) as c:
        st = c.stats()
        assert st["integrity_errors"] == 0 and st["sessions"] == 0 and st["extents"]["used_blocks"] == 0
        assert sum(st["io"][p][o]["errors"] for p in ("pagecache", "direct") for o in ("read", "write")) == 0
    assert res["sessions_opened"] >= SESSIONS and res["bytes_verified"] > 0
