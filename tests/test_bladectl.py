"""``bladectl`` against a running daemon (``--json`` parsed here), and the
storage commands on files and loop devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result
from daemon_util import ROOT, DaemonProcess, env_with_repo, short_tmpdir

from bladed.cli.bladectl import cli
from bladed.client import Client

GEOMETRY = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp, DaemonProcess(tmp, {"budget": {"override": 2 * KPU}}).start() as d:
        yield d


def bladectl(*args: str, socket: str | None = None, input: str | None = None) -> Result:
    pre = ["--socket", socket] if socket else []
    return CliRunner().invoke(cli, [*pre, *args], input=input, catch_exceptions=False)


def as_json(result: Result) -> dict:
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def test_status(daemon: DaemonProcess) -> None:
    st = as_json(bladectl("status", "--json", socket=daemon.socket_path))
    assert st["device"]["kind"] == "file" and st["device"]["lba_size"] == 4096
    assert st["region"] == {"start_lba": 0, "blocks": 16384, "bytes": 64 << 20}
    assert st["pid"] == daemon.pid and st["socket"] == daemon.socket_path
    human = bladectl("status", socket=daemon.socket_path).output
    assert "LBA 0 + 16384 blocks (64.0 MiB)" in human and f"pid {daemon.pid}" in human


def test_sessions_stats_budget_with_a_live_session(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEOMETRY, channels=2) as s:
        for layer in range(4):
            s.write(layer, "k", 0)
        s.read(0, "k", 1)
        rows = json.loads(bladectl("sessions", "--json", socket=daemon.socket_path).output)
        (row,) = [r for r in rows if r["session"] == s.id]
        assert (row["mode"], row["channels"], row["n1"], row["ops"]) == ("dualblade", 2, 1, 5)
        assert row["extent"]["nblocks"] == 6 * KPU // 4096 and row["pid"] == os.getpid()
        assert s.id in bladectl("sessions", socket=daemon.socket_path).output

        st = as_json(bladectl("stats", "--json", socket=daemon.socket_path))
        assert st["io"]["direct"]["write"]["ops"] >= 3 and st["io"]["direct"]["write"]["bytes"] >= 3 * KPU
        assert st["io"]["pagecache"]["read"]["ops"] >= 1 and st["pagecache"]["hit_ratio"] == 1.0
        assert st["sessions"] >= 1 and st["extents"]["used_blocks"] >= 6 * KPU // 4096

        b = as_json(bladectl("budget", "--json", socket=daemon.socket_path))
        for term in ("m_avail", "m_max", "m_anon_shmem", "m_star", "n_threads", "m_pin", "b_pc"):
            assert term in b["sample"], term
        assert b["sample"]["b_pc"] == b["override_bytes"] == 2 * KPU
        (mine,) = [x for x in b["sessions"] if x["session"] == s.id]
        assert (mine["channels"], mine["m_pin"], mine["x_bytes"], mine["n1"]) == (2, KPU, 2 * KPU, 1)
        human = bladectl("budget", socket=daemon.socket_path).output
        assert "[Eq. 1" in human and "[Eq. 2]" in human and f"session {s.id}" in human


def test_stats_watch_prints_one_json_object_per_refresh(daemon: DaemonProcess) -> None:
    r = bladectl("stats", "--watch", "--json", "--count", "3", "--interval", "0.01", socket=daemon.socket_path)
    lines = [json.loads(x) for x in r.output.splitlines()]
    assert len(lines) == 3 and lines[0]["time"] <= lines[2]["time"]
    r = bladectl("stats", "--watch", "--count", "2", "--interval", "0.01", socket=daemon.socket_path)
    assert r.output.count("page-cache hit ratio") == 2 and "MB/s" in r.output


def test_trim_only_without_sessions(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEOMETRY, channels=1):
        r = bladectl("trim", "--yes", socket=daemon.socket_path)
        assert r.exit_code == 1 and "session(s) open" in r.output
    assert bladectl("trim", socket=daemon.socket_path, input="n\n").exit_code == 1  # not confirmed
    t = as_json(bladectl("trim", "--yes", "--json", socket=daemon.socket_path))
    assert t["trimmed_bytes"] == 64 << 20 and t["blocks"] == 16384


def test_daemon_not_running_is_a_clear_error() -> None:
    r = bladectl("status", "--json", socket="/tmp/no-such-bladed.sock")
    assert r.exit_code == 1 and "bladed is not running" in r.output


def test_ns_list_on_a_host_without_nvme() -> None:
    data = as_json(bladectl("ns", "list", "--json"))
    assert data == {"controllers": [], "namespaces_without_controller": []}
    assert "no NVMe controllers found" in bladectl("ns", "list").output


def test_ns_check(store_dir: str) -> None:
    new = os.path.join(store_dir, "new.img")
    ok = as_json(bladectl("ns", "check", new, "--size", "16M", "--json"))
    assert ok["usable"] and ok["backend"] == "file"
    assert {c["check"] for c in ok["checks"]} >= {"kernel", "io_uring enabled", "memlock", "O_DIRECT"}
    bad = bladectl("ns", "check", new, "--json")  # no size: cannot be created
    assert bad.exit_code == 1 and not json.loads(bad.output)["usable"]
    missing = bladectl("ns", "check", "/dev/ng9n9", "--backend", "nvme")
    assert missing.exit_code == 1 and "does not exist" in missing.output


@pytest.mark.root
def test_ns_check_and_setup_on_a_loop_device(loop_device: str, store_dir: str) -> None:
    chk = as_json(bladectl("ns", "check", loop_device, "--json"))
    by = {c["check"]: c for c in chk["checks"]}
    assert chk["usable"] and chk["backend"] == "block"
    assert by["LBA size"]["status"] == "warn" and by["LBA size"]["detail"].startswith("512 bytes")
    assert by["read"]["status"] == "ok" and by["discard"]["status"] == "ok"
    r = bladectl("ns", "check", loop_device, "--region-start", str(1 << 30), "--json")
    assert r.exit_code == 1 and "past the end" in r.output

    cfg = os.path.join(store_dir, "etc", "bladed.toml")
    out = as_json(bladectl("ns", "setup", loop_device, "--region-start", "2048", "--state-dir", store_dir,
                           "--socket-path", "s.sock", "-o", cfg, "--json"))
    assert out["device"]["lba_size"] == 512 and out["systemd_dropin"].endswith(f"{loop_device} rw\n")
    check = subprocess.run([sys.executable, "-m", "bladed.server", "--config", cfg, "--check-config"], cwd=ROOT,
                           env=env_with_repo(), capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "configuration OK: block" in check.stdout and "region [2048," in check.stdout
    again = bladectl("ns", "setup", loop_device, "-o", cfg)
    assert again.exit_code == 1 and "--force" in again.output


def test_ns_setup_for_a_file_then_the_daemon_serves_it() -> None:
    with short_tmpdir() as tmp:
        cfg = os.path.join(tmp, "bladed.toml")
        r = bladectl("ns", "setup", os.path.join(tmp, "kv.img"), "--size", "32M", "--state-dir", tmp,
                     "--socket-path", "s.sock", "-o", cfg)
        assert r.exit_code == 0, r.output
        proc = subprocess.Popen([sys.executable, "-m", "bladed.server", "--config", cfg], cwd=ROOT,
                                env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # the daemon logs daemon_start once it is listening
                if "event=daemon_start" in line:
                    break
            st = as_json(bladectl("status", "--json", socket=os.path.join(tmp, "s.sock")))
            assert st["device"]["path"] == os.path.join(tmp, "kv.img") and st["region"]["bytes"] == 32 << 20
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
