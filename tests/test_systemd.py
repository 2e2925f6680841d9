"""The unit file, the udev rule, and the daemon's side of the systemd contract
(sd_notify READY/STATUS/RELOADING/STOPPING, journald log lines)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_util import ROOT, DaemonProcess, short_tmpdir

UNIT = os.path.join(ROOT, "systemd", "bladed.service")
DROPINS = os.path.join(ROOT, "systemd", "dropins")
RULE = os.path.join(ROOT, "udev", "60-bladed.rules")
BINARY = "/opt/bladed/bin/bladed"          # the install layout (tools/install.sh)
MAX_EXPOSURE = 2.5                         # systemd-analyze security's scale: 0 (safe) .. 10 (exposed)


def directives(path: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit or drop-in file, in order (a key may repeat)."""
    out: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", "[")):
                key, _, value = line.partition("=")
                out.setdefault(key, []).append(value)
    return out


def unit_dir(tmp_path: Path, *dropins: str) -> Path:
    """The shipped unit, its binary replaced by an executable, beside a ``bladed.service.d`` with
    ``dropins``: systemd-analyze reads the drop-in directory next to a unit file it is given."""
    exe = tmp_path / "bladed"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m bladed.server \"$@\"\n")
    exe.chmod(0o755)
    with open(UNIT) as f:
        text = f.read()
    assert text.count(BINARY) == 2  # ExecStartPre (config check) and ExecStart
    (tmp_path / "bladed.service").write_text(text.replace(BINARY, str(exe)))
    (tmp_path / "bladed.service.d").mkdir()
    for name in dropins:
        shutil.copyfile(os.path.join(DROPINS, name), tmp_path / "bladed.service.d" / name)
    return tmp_path / "bladed.service"


def exposure(unit: Path) -> float:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                       capture_output=True, text=True)
    m = re.search(r"Overall exposure level for bladed\.service: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


@pytest.mark.parametrize("dropins", [(), ("nvme-device.conf",), ("nvme-device.conf", "cap-sys-admin.conf"),
                                     ("nvme-device.conf", "cap-sys-admin.conf", "metrics-tcp.conf")],
                         ids=["shipped", "nvme", "nvme-kernel<6.2", "nvme-kernel<6.2-metrics-tcp"])
def test_unit_and_dropins_pass_verify_and_stay_below_exposure_2_5(tmp_path: Path, dropins: tuple[str, ...]) -> None:
    """Verified as shipped (and with the shipped drop-ins), only the binary path pointed at this checkout."""
    unit = unit_dir(tmp_path, *dropins)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    level = exposure(unit)
    print(f"systemd-analyze security, {' + '.join(('bladed.service', *dropins))}: {level}")
    assert level <= MAX_EXPOSURE


def test_unit_declares_notify_user_directories_and_hardening() -> None:
    d = directives(UNIT)
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["User"] == ["bladed"] and d["Group"] == ["bladed"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and d["KillSignal"] == ["SIGTERM"]
    assert d["RuntimeDirectory"] == ["bladed"] and d["StateDirectory"] == ["bladed"]
    assert d["LimitMEMLOCK"] == ["infinity"] and d["MemoryAccounting"] == ["yes"]
    # no capability, no device node, no network as shipped
    assert d["CapabilityBoundingSet"] == [""] and d["AmbientCapabilities"] == [""]
    assert d["PrivateDevices"] == ["yes"] and "DeviceAllow" not in d
    assert d["PrivateNetwork"] == ["yes"] and d["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert d["NoNewPrivileges"] == ["yes"] and d["ProtectSystem"] == ["strict"] and d["PrivateMounts"] == ["yes"]
    assert d["SystemCallFilter"][0].split()[:4] == ["@system-service", "io_uring_setup", "io_uring_enter",
                                                    "io_uring_register"]
    # the deprecated udev-settle is gone: nvme-device.conf orders the unit after its device
    with open(UNIT) as f:
        assert "systemd-udev-settle.service" not in f.read()
    # the unit's paths are the ones the shipped configuration uses
    with open(os.path.join(ROOT, "etc", "bladed.toml")) as f:
        cfg = f.read()
    assert 'state_dir = "/var/lib/bladed"' in cfg and 'path = "/run/bladed/bladed.sock"' in cfg
    assert d["ExecStart"] == [f"{BINARY} --config /etc/bladed/bladed.toml"]


def udev_rule() -> str:
    with open(RULE) as f:
        rules = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(rules) == 1
    return rules[0]


def test_udev_rule_gives_the_namespace_char_device_to_the_bladed_group() -> None:
    rule = udev_rule()
    pairs = dict(re.findall(r'([A-Z]+(?:\{\w+\})?)[=!+:]?=\s*"([^"]*)"', rule))
    assert pairs["SUBSYSTEM"] == "nvme-generic" and pairs["KERNEL"].startswith("ng")
    assert (pairs["GROUP"], pairs["MODE"], pairs["SYMLINK"], pairs["TAG"]) == ("bladed", "0660", "bladed/kv", "systemd")
    # the namespace by its NSID (from its block device), not by the Y of ngXnY
    assert pairs["PROGRAM"].endswith("/nsid") and pairs["RESULT"] == "1"
    assert all(re.fullmatch(r'[A-Z]+(\{\w+\})?(==|!=|\+=|:=|=)"[^"]*"', p.strip()) for p in rule.split(", "))


def test_nvme_dropin_resets_the_device_acl_and_waits_for_the_rule_s_device() -> None:
    d = directives(os.path.join(DROPINS, "nvme-device.conf"))
    link = "/dev/" + dict(re.findall(r'([A-Z]+)\+?=\s*"([^"]*)"', udev_rule()))["SYMLINK"]
    device_unit = subprocess.run(["systemd-escape", "--path", "--suffix=device", link], capture_output=True,
                                 text=True, check=True).stdout.strip()
    assert device_unit == "dev-bladed-kv.device"
    assert d["BindsTo"] == [device_unit] and d["After"] == [device_unit]
    # an empty DeviceAllow= first: the drop-in replaces the list instead of adding to it
    assert d["DeviceAllow"] == ["", f"{link} rw"] and d["DevicePolicy"] == ["closed"]
    assert d["PrivateDevices"] == ["no"]


def test_notify_sequence_reload_and_graceful_stop() -> None:
    with short_tmpdir() as tmp, DaemonProcess(tmp, {"log": {"level": "info"}}).start() as d:
        ready = d.notifications[:]
        assert "READY=1" in ready and any(x.startswith("STATUS=serving on ") for x in ready)
        assert f"MAINPID={d.pid}" in ready
        d.config["log"]["level"] = "debug"
        d.config["device"]["size"] = "128M"
        d.write_config()
        hup = d.signal(signal.SIGHUP)
        ev = d.wait_event("reload", after=hup)
        assert (ev["applied"], ev["needs_restart"]) == ("log.level", "device.size")
        # the reload's own READY=1, not the start's: RELOADING=1 comes before it
        d.wait_notify("READY=1", after=hup)
        reload = d.notifications_after(hup)
        assert "RELOADING=1" in reload and reload.index("RELOADING=1") < reload.index("READY=1"), reload
        stop = d.mark()
        assert d.stop() == 0
        assert "STOPPING=1" in d.notifications_after(stop), d.notifications_after(stop)


def test_journald_log_lines_carry_priorities() -> None:
    with short_tmpdir() as tmp, DaemonProcess(tmp, env={"JOURNAL_STREAM": "8:1234"}).start() as d:
        line = d.wait_line("event=daemon_start")
        assert line.startswith("<6>level=info logger=bladed.events event=daemon_start ")
        stop = d.mark()
        assert d.stop() == 0
        assert d.wait_line("event=daemon_stop", after=stop).startswith("<6>")


@pytest.mark.parametrize("bad,message", [
    ({"device": {"region_start_lba": 1 << 20}}, "past the end"),
    ({"io": {"queue_depth": 0}}, "io.queue_depth"),
])
def test_bad_config_stops_start_with_a_clear_message(bad: dict, message: str) -> None:
    with short_tmpdir() as tmp, DaemonProcess(tmp, bad).start(wait=False) as d:
        assert d.proc is not None and d.proc.wait(60) == 2
        assert d.stop() == 2                    # returns with every line and notification in
        d.wait_line(message)                    # what the start caused: the run's only lines
        assert "READY=1" not in d.notifications
