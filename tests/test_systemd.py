"""The unit file, the udev rule, and the daemon's side of the systemd contract
(sd_notify READY/STATUS/RELOADING/STOPPING, journald log lines)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from daemon_util import ROOT, DaemonProcess, short_tmpdir

UNIT = os.path.join(ROOT, "systemd", "bladed.service")
RULE = os.path.join(ROOT, "udev", "60-bladed.rules")
BINARY = "/usr/local/bin/bladed"


def unit_directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    with open(UNIT) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", "[")):
                key, _, value = line.partition("=")
                out.setdefault(key, []).append(value)
    return out


def test_unit_passes_systemd_analyze_verify(tmp_path) -> None:
    """Verified as shipped, with only the binary path pointed at this checkout's bladed."""
    exe = tmp_path / "bladed"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m bladed.server \"$@\"\n")
    exe.chmod(0o755)
    with open(UNIT) as f:
        text = f.read()
    assert text.count(BINARY) == 2  # ExecStartPre (config check) and ExecStart
    unit = tmp_path / "bladed.service"
    unit.write_text(text.replace(BINARY, str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_unit_declares_notify_directories_and_hardening() -> None:
    d = unit_directives()
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and d["KillSignal"] == ["SIGTERM"]
    assert d["RuntimeDirectory"] == ["bladed"] and d["StateDirectory"] == ["bladed"]
    assert d["NoNewPrivileges"] == ["yes"] and d["ProtectSystem"] == ["strict"]
    assert d["DevicePolicy"] == ["closed"] and d["DeviceAllow"] == ["/dev/ng0n1 rw"]
    assert d["LimitMEMLOCK"] == ["infinity"] and d["MemoryAccounting"] == ["yes"]
    # the unit's paths are the ones the shipped configuration uses
    with open(os.path.join(ROOT, "etc", "bladed.toml")) as f:
        cfg = f.read()
    assert 'state_dir = "/var/lib/bladed"' in cfg and 'path = "/run/bladed/bladed.sock"' in cfg
    assert d["ExecStart"] == [f"{BINARY} --config /etc/bladed/bladed.toml"]


def test_udev_rule_gives_the_namespace_char_device_to_the_bladed_group() -> None:
    with open(RULE) as f:
        rules = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(rules) == 1
    pairs = dict(re.findall(r'([A-Z]+(?:\{\w+\})?)[=!+:]?=\s*"([^"]*)"', rules[0]))
    assert pairs["SUBSYSTEM"] == "nvme-generic" and pairs["KERNEL"].startswith("ng")
    assert (pairs["GROUP"], pairs["MODE"], pairs["SYMLINK"]) == ("bladed", "0660", "bladed/kv")
    assert all(re.fullmatch(r'[A-Z]+(\{\w+\})?(==|!=|\+=|:=|=)"[^"]*"', p.strip()) for p in rules[0].split(", "))


def test_notify_sequence_reload_and_graceful_stop() -> None:
    with short_tmpdir() as tmp:
        d = DaemonProcess(tmp, {"log": {"level": "info"}}).start()
        ready = d.notifications[:]
        assert "READY=1" in ready and any(x.startswith("STATUS=serving on ") for x in ready)
        assert f"MAINPID={d.pid}" in ready
        d.config["log"]["level"] = "debug"
        d.config["device"]["size"] = "128M"
        d.write_config()
        d.signal(signal.SIGHUP)
        ev = d.wait_event("reload")
        assert (ev["applied"], ev["needs_restart"]) == ("log.level", "device.size")
        d.wait_notify("READY=1")
        assert "RELOADING=1" in d.notifications
        assert d.stop() == 0
        assert "STOPPING=1" in d.notifications
        assert d.notifications.index("STOPPING=1") > d.notifications.index("RELOADING=1")


def test_journald_log_lines_carry_priorities() -> None:
    with short_tmpdir() as tmp:
        d = DaemonProcess(tmp, env={"JOURNAL_STREAM": "8:1234"}).start()
        line = d.wait_line("event=daemon_start")
        assert line.startswith("<6>bladed.events: event=daemon_start ")
        assert d.stop() == 0
        assert d.wait_line("event=daemon_stop").startswith("<6>")


@pytest.mark.parametrize("bad,message", [
    ({"device": {"region_start_lba": 1 << 20}}, "past the end"),
    ({"io": {"queue_depth": 0}}, "io.queue_depth"),
])
def test_bad_config_stops_start_with_a_clear_message(bad: dict, message: str) -> None:
    with short_tmpdir() as tmp:
        d = DaemonProcess(tmp, bad).start(wait=False)
        assert d.proc is not None and d.proc.wait(60) == 2
        d.wait_line(message)
        assert "READY=1" not in d.notifications
