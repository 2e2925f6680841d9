"""bladed on a real NVMe namespace (QEMU's controller, inside the NVMe VM),
driven by a client process in the same VM: both paths round-trip, the
extent is deallocated on close, and bladectl sees the controller.

Kept to one daemon start: under TCG every Python start-up costs seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from nvmevm import GENERIC_NODES, NG_PATH, VMConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import seccomp_util
from daemon_util import ROOT, ClientProcess, DaemonProcess, env_with_repo, short_tmpdir

from bladed.cli.bladectl import cli
from bladed.io import Engine, StagingBuffer
from bladed.io.nvme import NvmeDevice

pytestmark = pytest.mark.nvme_vm

TIMEOUT = 600.0   # TCG: a daemon start or a client command can take tens of seconds


def test_daemon_on_the_namespace_with_a_client_in_the_vm(vm_config: VMConfig) -> None:
    lba = vm_config.lba_size
    # token = 2*8*128*2 = 4096 bytes: aligned on 512- and 4096-byte LBAs
    geometry = {"layers": 3, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 16}
    kpu = 16 * 4096
    region_start = 8 * 4096 // lba          # not at LBA 0, to check the region is honoured
    cfg = {"device": {"backend": "nvme", "path": NG_PATH, "region_start_lba": region_start,
                      "region_blocks": 64 * kpu // lba, "lba_size": lba},
           "budget": {"override": 2 * kpu}}
    with short_tmpdir() as tmp, DaemonProcess(tmp, cfg) as d:
        d.start(timeout=TIMEOUT)
        with ClientProcess(d.socket_path, timeout=TIMEOUT) as c:
            assert c.call("connect", timeout=TIMEOUT)["server"]["lba_size"] == lba
            opened = c.call("open", geometry=geometry, timeout=TIMEOUT)
            ext = opened["extent"]
            assert ext == {"start": region_start, "nblocks": 4 * kpu // lba}
            assert c.call("write_all", seed=21, timeout=TIMEOUT)["paths"] == ["pagecache"] * 2 + ["direct"] * 4
            assert c.call("check_all", seed=21, timeout=TIMEOUT)["bad"] == []
            c.call("write", layer=2, kind="v", token_start=9, ntokens=1, seed=22, timeout=TIMEOUT)
            assert c.call("read_check", layer=2, kind="v", token_start=9, ntokens=1, seed=22,
                          timeout=TIMEOUT)["match"]
            assert c.call("read_check", layer=2, kind="v", token_start=0, ntokens=9, seed=21,
                          timeout=TIMEOUT)["match"]
            st = CliRunner().invoke(cli, ["--socket", d.socket_path, "stats", "--json"])
            assert json.loads(st.output)["io"]["direct"]["write"]["bytes"] == 4 * kpu + 4096
            close = d.mark()
            c.call("close", timeout=TIMEOUT)
            closed = d.wait_event("session_close", TIMEOUT, after=close, session=opened["session"])
            assert int(closed["trimmed_bytes"]) == ext["nblocks"] * lba
        assert d.stop(TIMEOUT) == 0

    # Dataset Management deallocate: QEMU's drive (discard=unmap, DLFEAT=1) reads back zeroes
    dev = NvmeDevice(NG_PATH)
    try:
        assert dev.identity.deallocate_reads_zeroes
        nbytes = ext["nblocks"] * lba
        # unregistered: Linux 6.1 refuses fixed-buffer commands far from the end of a large buffer
        with StagingBuffer(nbytes) as buf, Engine(dev, 8) as eng:
            buf.view()[:] = b"\xff" * nbytes
            eng.read(ext["start"], buf, nbytes=nbytes)
            assert buf.view().tobytes() == bytes(nbytes)
    finally:
        dev.close()


def test_a_daemon_allowed_neither_io_uring_nor_the_nvme_ioctls_refuses_to_start(vm_config: VMConfig) -> None:
    """Under a filter denying io_uring (auto: the portable engine) and the NVMe I/O passthrough ioctls, the nvme
    backend cannot move a byte: start-up says so in one line, exit status 2, never a daemon whose sessions fail."""
    with short_tmpdir() as tmp:
        config = os.path.join(tmp, "bladed.toml")
        with open(config, "w") as f:
            f.write(f'[device]\nbackend = "nvme"\npath = "{NG_PATH}"\nlba_size = {vm_config.lba_size}\n'
                    f"region_blocks = {(64 << 20) // vm_config.lba_size}\n")
        r = subprocess.run(seccomp_util.command([sys.executable, "-m", "bladed.server", "--config", config,
                                                 "--state-dir", tmp], deny_nvme_ioctls=True),
                           capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env_with_repo())
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"device.path: {NG_PATH}: NVMe passthrough by the NVMe passthrough ioctl" in lines[0], lines[0]
    assert "EPERM" in lines[0] and "allow io_uring or the NVMe ioctls" in lines[0], lines[0]


# bladectl's storage commands (bladed/cli/storage.py, target_backend) take a block node /dev/nvmeXnY for the block
# backend unless told --backend nvme: on a kernel without /dev/ngXnY (5.10) that is how the namespace is named
AS_NVME = [] if GENERIC_NODES else ["--backend", "nvme"]


def test_bladectl_sees_the_controller_and_accepts_the_namespace(vm_config: VMConfig) -> None:
    runner = CliRunner()
    listed = json.loads(runner.invoke(cli, ["ns", "list", "--json"]).output)
    (ctrl,) = listed["controllers"]
    (ns,) = [n for n in ctrl["namespaces"] if n["char_device"] == NG_PATH]
    assert ns["lba_size"] == vm_config.lba_size and ns["identified"]
    assert any(f["current"] and f["lba_size"] == vm_config.lba_size for f in ns["lba_formats"])
    checked = runner.invoke(cli, ["ns", "check", NG_PATH, *AS_NVME, "--json"])
    assert checked.exit_code == 0, checked.output
    by = {c["check"]: c for c in json.loads(checked.output)["checks"]}
    assert by["read"]["status"] == "ok" and by["deallocate"]["status"] == "ok"
    assert by["LBA size"]["status"] == ("ok" if vm_config.lba_size == 4096 else "warn")


def current_lba() -> int:
    dev = NvmeDevice(NG_PATH)
    try:
        return dev.lba_size
    finally:
        dev.close()


def test_ns_setup_formats_the_namespace_only_when_confirmed(vm_config: VMConfig, tmp_path) -> None:
    """Format NVM to the other LBA size and back (the namespace is the VM's throw-away one)."""
    lba = vm_config.lba_size
    other = 512 if lba == 4096 else 4096
    runner = CliRunner()
    cfg = str(tmp_path / "bladed.toml")
    args = ["ns", "setup", NG_PATH, *AS_NVME, "--format-lba", str(other), "--state-dir", str(tmp_path), "-o", cfg]
    refused = runner.invoke(cli, args, input="n\n")
    assert refused.exit_code == 1 and "EVERY BYTE ON IT IS LOST" in refused.output
    assert current_lba() == lba and not os.path.exists(cfg)
    try:
        done = runner.invoke(cli, [*args, "--yes", "--json"])
        assert done.exit_code == 0, done.output
        out = json.loads(done.output)
        assert out["device"]["lba_size"] == other and out["formatted_lba_format"] is not None
        assert current_lba() == other
        with open(cfg) as f:
            assert f"lba_size = {other}" in f.read()
    finally:
        back = runner.invoke(cli, ["ns", "setup", NG_PATH, *AS_NVME, "--format-lba", str(lba), "--yes", "-o", "-"])
        assert back.exit_code == 0, back.output
        assert current_lba() == lba
