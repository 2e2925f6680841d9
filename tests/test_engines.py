"""Where io_uring is refused (a container's default seccomp profile, emulated with a real seccomp filter on the
daemon's process), ``io.engine = "auto"`` runs the daemon on the portable engine, says so once at start with
the reason, and serves KV as on io_uring; ``"uring"`` there is one line naming the key and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import seccomp_util
from daemon_util import ROOT, DaemonProcess, UnixHTTPConnection, env_with_repo, scrape

from bladed.client import Client
from bladed.residency import Geometry

GEO = Geometry(layers=2, batch=1, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=32)
KPU = GEO.kpu_bytes
CHOICE = "from bladed.io import engines; c = engines.choose('auto', {!r}); print(c.engine, '|', c.reason)"


def choice_in_child(backend: str, *, seccomp: bool) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", CHOICE.format(backend)], capture_output=True, text=True,
                         check=True, env=env_with_repo(), cwd=ROOT,
                         preexec_fn=seccomp_util.deny_io_uring if seccomp else None).stdout
    engine, reason = out.strip().split(" | ")
    return engine, reason


@pytest.mark.parametrize("backend", ["file", "block", "nvme"])
def test_auto_picks_io_uring_where_it_works_and_portable_under_seccomp(backend: str) -> None:
    assert choice_in_child(backend, seccomp=False) == ("uring", "io_uring available")
    engine, reason = choice_in_child(backend, seccomp=True)
    assert engine == "portable"
    assert reason.startswith("io_uring unavailable: EPERM") and "seccomp" in reason


def test_daemon_under_seccomp_serves_kv_on_the_portable_engine(tmp: str) -> None:
    # B_pc of one layer's K+V: layer 0 on the page-cache path, layer 1 on the direct path (the engine's)
    metrics = os.path.join(tmp, "metrics.sock")
    config = {"budget": {"override": 2 * KPU}, "metrics": {"enabled": True, "listen": f"unix:{metrics}"}}
    with DaemonProcess(tmp, config, wrap=seccomp_util.command).start() as d:
        line = d.wait_line("I/O engine: ")
        assert "I/O engine: portable (io_uring unavailable: EPERM" in line and "WARNING" in line.upper(), line
        with Client(d.socket_path) as c:
            status = c.status()
            assert status["engine"]["engine"] == "portable" and "seccomp" in status["engine"]["reason"]
            with c.open_session(GEO, channels=2) as s:
                assert [k["path"] for k in s.plan["kpus"]] == ["pagecache"] * 2 + ["direct"] * 2
                data = {}
                for layer in range(GEO.layers):
                    for kind in ("k", "v"):
                        data[layer, kind] = os.urandom(KPU)
                        s.slot(0)[:] = data[layer, kind]
                        s.write(layer, kind, 0)
                for (layer, kind), want in data.items():
                    s.slot(1)[:] = bytes(KPU)
                    r = s.read(layer, kind, 1)
                    assert bytes(s.slot(1)) == want and r.nbytes == KPU
        m = scrape(UnixHTTPConnection(metrics))
        assert m[("bladed_io_engine_info", (("engine", "portable"),))] == 1


def test_uring_engine_where_io_uring_is_refused_is_one_line_naming_the_key(tmp: str) -> None:
    config = os.path.join(tmp, "bladed.toml")
    with open(config, "w") as f:
        f.write('[device]\nsize = "16M"\n[io]\nengine = "uring"\n')
    r = subprocess.run(seccomp_util.command([sys.executable, "-m", "bladed.server", "--config", config,
                                             "--state-dir", tmp]),
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env_with_repo())
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert 'io.engine = "uring" but io_uring unavailable: EPERM' in lines[0]
    assert 'set io.engine = "auto"' in lines[0]


def test_unknown_engine_is_a_config_error(tmp: str) -> None:
    config = os.path.join(tmp, "bladed.toml")
    with open(config, "w") as f:
        f.write('[io]\nengine = "spdk"\n')
    r = subprocess.run([sys.executable, "-m", "bladed.server", "--config", config, "--check-config"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env_with_repo())
    assert r.returncode == 2
    assert "io.engine: must be one of 'auto', 'uring', 'portable', got 'spdk'" in r.stderr
