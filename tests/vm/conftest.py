"""Tests in this directory run INSIDE the throw-away QEMU NVMe VM.

They write all over ``/dev/ng0n1``, so they refuse to run anywhere else: the
host's test run never collects this directory (``collect_ignore`` in
``tests/conftest.py``); ``tests/test_nvme_vm.py`` boots one VM per device
configuration and runs the whole directory inside it::

    python -m pytest tests/test_nvme_vm.py            # from the host, all configurations
    tools/vm/nvme/run-in-nvme-vm.sh --lba 4096 --mdts 5 --size 5G --faulty-sector 2048 -- \\
        "$(python3 -c 'import sys; print(sys.executable)')" -m pytest tests/vm -m nvme_vm

Run by hand anywhere without the VM's namespace, pytest stops with a usage
error before it collects anything.  Every test collected here carries the
``nvme_vm`` marker, whether or not its module says so, so that
``-m nvme_vm`` (what the host passes) never silently drops a test that
someone added without the marker.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from nvmevm import GENERIC_NODES, NG_PATH, VMConfig

from bladed.io import Op, Ring, StagingBuffer, Transfer, features, open_device
from bladed.io.nvme import NvmeDevice
from bladed.sizes import PAGE_SIZE

HERE = Path(__file__).resolve().parent


def _vm_problem() -> str | None:
    """Why this is not the NVMe test VM, or None if it is."""
    if os.environ.get("NVMEVM_GUEST") != "1":
        return "NVMEVM_GUEST=1 is not set (these tests write to the whole namespace: VM only)"
    try:
        st = os.stat(NG_PATH)
    except OSError as e:
        return f"{NG_PATH} is missing ({e.strerror})"
    if not (stat.S_ISCHR(st.st_mode) or (stat.S_ISBLK(st.st_mode) and not GENERIC_NODES)):
        return f"{NG_PATH} is not a character device"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # tests that need the VM booted with --init systemd (tests/test_nvme_vm.py selects them by this marker)
    config.addinivalue_line("markers", "systemd_vm: needs systemd as PID 1 on a cgroup-v2-only kernel "
                                       "(run-in-nvme-vm.sh --init systemd)")
    config.addinivalue_line("markers", "kernel_feature(name, reason=...): needs a feature of bladed.io.features "
                                       "(or the io_uring_disabled sysctl) that older guest kernels lack; skipped, "
                                       "with the probe's answer and the reason, where missing (tests/test_nvme_vm.py "
                                       "allows that per case)")
    problem = _vm_problem()
    if problem is not None:
        raise pytest.UsageError(
            f"tests/vm must run inside the QEMU NVMe VM: {problem}.\n"
            "Run `python -m pytest tests/test_nvme_vm.py` on the host (boots the VM), or by hand:\n"
            "  tools/vm/nvme/run-in-nvme-vm.sh [--lba 512|4096] [--mdts N] --faulty-sector 2048 -- "
            "<python> -m pytest tests/vm -m nvme_vm"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.nvme_vm)


def kernel_feature(name: str) -> tuple[bool, str]:
    """Whether the guest has feature ``name`` (a function of bladed.io.features, or ``io_uring_disabled``), and why."""
    if name == "io_uring_disabled":
        return os.path.exists("/proc/sys/kernel/io_uring_disabled"), "no kernel.io_uring_disabled: kernel < 6.6"
    f = getattr(features, name)()
    return f.available, f.detail


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``kernel_feature(name)`` skips as "needs NAME: why" on a kernel without it."""
    for mark in item.iter_markers("kernel_feature"):
        ok, why = kernel_feature(mark.args[0])
        if not ok:
            reason = mark.kwargs.get("reason")
            pytest.skip(f"needs {mark.args[0]}: {why}" + (f"; {reason}" if reason else ""))


@pytest.fixture(scope="session")
def vm_config() -> VMConfig:
    """The LBA size, MDTS and namespace size the VM was booted with."""
    return VMConfig.from_env()


@pytest.fixture(scope="session")
def nvme_dev() -> Iterator[NvmeDevice]:
    """The VM's namespace through the bladed NVMe backend (shared by the session)."""
    dev = open_device("nvme", NG_PATH)
    assert isinstance(dev, NvmeDevice)
    yield dev
    dev.close()


@pytest.fixture(scope="session")
def fixed_partial_commands_ok(nvme_dev: NvmeDevice) -> bool:
    """Whether this kernel takes any fixed-buffer (registered) passthrough command
    that fits the device's limits, wherever it starts in its registered buffer.

    Debian 12's 6.1 kernel does not: blk_rq_map_user_bvec() checks the
    iterator's segment count against ``max_segments``, and io_import_fixed()
    leaves that count running to the END of the registered buffer, so a
    command is refused with EINVAL when more than ``max_segments`` pages lie
    between its start and the end of its buffer (seen here: a 4 KiB read at
    the start of a 128-page buffer fails with max_segments 127, succeeds 1 page
    further on).  6.12 takes it.  Probed with a bare Ring, so that a fallback
    inside bladed's Engine cannot hide the kernel's answer.  False on the
    portable engine (a kernel without io_uring_cmd, 5.10): it registers nothing.
    """
    if nvme_dev.engine != "uring":
        return False
    assert nvme_dev.sysfs_block
    segments = int((Path(nvme_dev.sysfs_block) / "queue" / "max_segments").read_text())
    with StagingBuffer((segments + 1) * PAGE_SIZE) as buf, Ring(1, big_sqe=True) as ring:
        assert ring.register_buffers([buf]), "cannot register a buffer (RLIMIT_MEMLOCK?)"
        target = nvme_dev.make_target()
        x = Transfer(target, Op.READ, 0, nvme_dev.lba_size, buf.address, (buf, target))
        ring.run([x])
        assert x.registered
        err = x.error()
        if err is None:
            return True
        assert isinstance(err, OSError) and err.errno == errno.EINVAL, err
        return False
