"""Wear on a real NVMe namespace (QEMU's controller, inside the NVMe VM): the SMART figures ``bladectl wear``
shows are ``nvme smart-log``'s; the drive's count of data written moves by what bladed says it wrote; the
kernel's count of the namespace leaves NVMe passthrough out (unless the kernel is asked to count it); the
write budget on the nvme backend; the drive's metrics; and a process without CAP_SYS_ADMIN is refused the log
with the one line that says so (docs/operations.md, "Wear").

One daemon start: under TCG every Python start-up costs seconds.  ``nvme`` (nvme-cli) comes from the host's
root filesystem, which the VM mounts (tools/setup.sh installs it).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner
from nvmevm import NG_PATH, VMConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import DaemonProcess, UnixHTTPConnection, forked_as, scrape, short_tmpdir

from bladed.cli.bladectl import cli
from bladed.client import Client, WriteBudgetExhaustedError
from bladed.io.nvme import NvmeDevice
from bladed.io.smart import DATA_UNIT_BYTES, SmartUnavailable, read_smart_log

pytestmark = pytest.mark.nvme_vm

TIMEOUT = 600.0
NOBODY = 65534
NVME = shutil.which("nvme")
#: the SMART fields bladed reports -> nvme-cli's JSON names (nvme-cli 2.x, `nvme smart-log -o json`)
NVME_CLI = {"critical_warning": "critical_warning", "available_spare": "avail_spare",
            "available_spare_threshold": "spare_thresh", "percentage_used": "percent_used",
            "data_units_read": "data_units_read", "data_units_written": "data_units_written",
            "host_read_commands": "host_read_commands", "host_write_commands": "host_write_commands",
            "controller_busy_minutes": "controller_busy_time", "power_cycles": "power_cycles",
            "power_on_hours": "power_on_hours", "unsafe_shutdowns": "unsafe_shutdowns",
            "media_errors": "media_errors", "error_log_entries": "num_err_log_entries"}
#: token = 2*8*128*2 = 4096 bytes (whole LBAs on 512- and 4096-byte LBAs); 3 layers -> 6 KPUs of 16 tokens
GEOMETRY = {"layers": 3, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 16}
KPU = 16 * 4096


def nvme_smart_log() -> dict[str, Any]:
    """``nvme smart-log`` of the controller (all namespaces, its default), as JSON."""
    out = subprocess.run([str(NVME), "smart-log", _controller(), "-o", "json"], capture_output=True, text=True,
                         timeout=120, check=True)
    return dict(json.loads(out.stdout))


def _controller() -> str:
    """The controller's char device of the namespace the tests use (``/dev/nvme0``)."""
    m = re.fullmatch(r"(?:ng|nvme)(\d+)n\d+", os.path.basename(os.path.realpath(NG_PATH)))
    assert m, NG_PATH
    return f"/dev/nvme{m.group(1)}"


def as_nvme_cli(smart: dict[str, Any]) -> dict[str, int]:
    return {theirs: int(smart[ours]) for ours, theirs in NVME_CLI.items()}


def test_wear_figures_on_the_namespace_and_the_write_budget(vm_config: VMConfig) -> None:
    assert NVME, "nvme-cli is missing: tools/setup.sh installs it (the VM runs on the host's root filesystem)"
    lba = vm_config.lba_size
    cfg = {"device": {"backend": "nvme", "path": NG_PATH, "region_blocks": 64 * KPU // lba, "lba_size": lba,
                      "endurance_tbw": 1},
           "io": {"write_budget": "256K"},
           "metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
    with short_tmpdir() as tmp, DaemonProcess(tmp, cfg) as d:
        d.start(timeout=TIMEOUT)
        with Client(d.socket_path, timeout=TIMEOUT) as c:
            before = c.wear()
            assert before["backend"] == "nvme" and before["smart"] is not None, before["smart_error"]
            with c.open_session(GEOMETRY, mode="direct", channels=1) as s:
                for layer in range(3):
                    for kind in "kv":
                        s.write(layer, kind, 0, 0, 16)             # 6 KPUs, 384 KiB: past the 256 KiB budget
                row = next(r for r in c.sessions() if r["session"] == s.id)
                assert row["direct_written_bytes"] == row["kv_written_bytes"]["direct"] == 6 * KPU
            after = c.wear()

            # the drive counted what bladed says it wrote: both ends round up to whole data units of 512,000 bytes
            bladed = after["today"]["direct_bytes"] - before["today"]["direct_bytes"]
            assert bladed == 6 * KPU
            drive = (after["smart"]["data_units_written"] - before["smart"]["data_units_written"]) * DATA_UNIT_BYTES
            assert abs(drive - bladed) < DATA_UNIT_BYTES, (drive, bladed)
            assert after["smart"]["host_write_commands"] > before["smart"]["host_write_commands"]
            # the kernel's count of the namespace: NVMe passthrough is in it only where the kernel is asked
            store = after["kernel"]["store"]
            grown = store["written_bytes"] - before["kernel"]["store"]["written_bytes"]
            print(f"kernel {os.uname().release}: {store['device']} stat grew by {grown} bytes while bladed wrote "
                  f"{bladed} by passthrough (passthrough_counted {store['passthrough_counted']})")
            counted = store["passthrough_counted"]
            if counted is None:
                # the kernel has no switch: 5.10 counts the block node's NVMe ioctls, 6.x leaves io_uring_cmd out
                assert grown == 0 or grown >= bladed
            else:
                assert grown >= bladed if counted else grown == 0

            # bladectl wear shows the drive's own log: nvme smart-log's figures, read on both sides of it
            got = CliRunner().invoke(cli, ["--socket", d.socket_path, "wear", "--json"])
            assert got.exit_code == 0, got.output
            mine = json.loads(got.output)["smart"]
            theirs = nvme_smart_log()
            again = c.wear()["smart"]
            assert as_nvme_cli(mine) == as_nvme_cli(again), "the drive's figures moved while idle"
            assert as_nvme_cli(mine) == {k: int(theirs[k]) for k in NVME_CLI.values()}, theirs
            assert int(theirs["temperature"]) in (mine["temperature_kelvin"], mine["temperature_celsius"])
            human = CliRunner().invoke(cli, ["--socket", d.socket_path, "wear"])
            print(human.output)
            assert f"{mine['percentage_used']} %" in human.output
            assert f"{mine['data_units_written']} / {mine['data_units_read']} units of 512000 bytes" in human.output

            # the write budget on the nvme backend: a new direct spill is refused, the page-cache path opens
            assert after["write_budget"]["exhausted"]
            with pytest.raises(WriteBudgetExhaustedError, match=r"io\.write_budget allows 256\.0 KiB a day"):
                c.open_session(GEOMETRY, mode="direct", channels=1)
            with c.open_session(GEOMETRY, mode="cachepolicy", channels=1) as pc:
                assert pc.write(0, "k", 0, 0, 2).path == "pagecache"

            # the drive's metrics (docs/operations.md lists the nvme-only ones)
            m = scrape(UnixHTTPConnection(os.path.join(tmp, "metrics.sock")))
            names = {name for name, _ in m}
            for metric in ("bladed_nvme_data_written_bytes_total", "bladed_nvme_data_read_bytes_total",
                           "bladed_nvme_host_write_commands_total", "bladed_nvme_host_read_commands_total",
                           "bladed_nvme_media_errors_total", "bladed_nvme_power_on_seconds_total",
                           "bladed_nvme_percentage_used", "bladed_nvme_available_spare",
                           "bladed_nvme_available_spare_threshold", "bladed_nvme_critical_warning",
                           "bladed_nvme_temperature_celsius", "bladed_endurance_bytes"):
                assert metric in names, metric
            assert m[("bladed_endurance_bytes", ())] == 10**12
            assert m[("bladed_nvme_percentage_used", ())] == mine["percentage_used"]
            assert m[("bladed_write_budget_refusals_total", (("what", "session"),))] == 1
        assert d.stop(TIMEOUT) == 0
        with open(os.path.join(tmp, "wear.json")) as f:
            ledger = json.load(f)
        assert ledger["total"]["direct"]["requests"] == 6 * KPU
        assert len(ledger["smart"]["readings"]) == 1 and ledger["smart"]["drive"].startswith("QEMU NVMe Ctrl ")


def test_a_process_without_cap_sys_admin_is_refused_the_smart_log() -> None:
    """Get Log Page is an admin command: Linux sends it only for CAP_SYS_ADMIN, on every kernel, whatever the
    node's mode; the refusal is the one line naming what to allow."""
    dev = NvmeDevice(NG_PATH)            # opened read-write by root, as systemd hands bladed its device
    try:
        assert read_smart_log(dev.fd, NG_PATH).available_spare_threshold >= 0     # root: allowed

        def body(out: dict[str, Any]) -> None:
            try:
                read_smart_log(dev.fd, NG_PATH)
                out["read"] = "ok"
            except SmartUnavailable as e:
                out["errno"], out["message"] = e.errno, e.strerror

        got = forked_as(NOBODY, body)
    finally:
        dev.close()
    assert got.get("errno") == errno.EACCES, got
    assert got["message"].startswith(f"{NG_PATH}: the drive's SMART / Health log (NVMe Get Log Page 02h) is "
                                     "refused (EACCES): ") and "CAP_SYS_ADMIN" in got["message"]
