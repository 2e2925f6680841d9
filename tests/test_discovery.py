"""bladed.io.discovery on the host (no NVMe here; tests/vm covers a real controller)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import pyudev

from bladed.io.discovery import (
    block_name_for,
    find_namespace,
    list_controllers,
    list_namespaces,
)


def _sysfs_names(cls: str) -> list[str]:
    d = Path("/sys/class") / cls
    return sorted(os.listdir(d)) if d.is_dir() else []


def test_lists_exactly_the_namespaces_sysfs_shows() -> None:
    """On this host: none, and no crash; on a host with NVMe: every ngXnY."""
    found = list_namespaces()
    assert sorted(os.path.basename(ns.char_device) for ns in found) == _sysfs_names("nvme-generic")


def test_lists_exactly_the_controllers_sysfs_shows() -> None:
    assert sorted(c.name for c in list_controllers()) == _sysfs_names("nvme")


def test_unknown_device_is_not_found() -> None:
    assert find_namespace("/dev/ng99n99") is None


@pytest.mark.parametrize(("generic", "block"), [
    ("ng0n1", "nvme0n1"),
    ("ng12n3", "nvme12n3"),
    ("nvme0n1", None),
    ("ng0", None),
    ("ng0n1p1", None),
])
def test_block_name_for_generic_name(generic: str, block: str | None) -> None:
    assert block_name_for(generic) == block


class FakeAttributes:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def asstring(self, name: str) -> str:
        return self.values[name]          # KeyError when absent, as pyudev


class FakeDevice:
    def __init__(self, name: str, subsystem: str, parent: FakeDevice | None = None,
                 node: str | None = None, **attrs: str) -> None:
        self.sys_name = name
        self.subsystem = subsystem
        self.parent = parent
        self.device_node = node
        self.attributes = FakeAttributes({k.replace("__", "/"): v for k, v in attrs.items()})


class FakeContext:
    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices

    def list_devices(self, subsystem: str) -> list[FakeDevice]:
        return [d for d in self.devices if d.subsystem == subsystem]


def test_sysfs_only_view_of_a_multipath_head_and_a_namespace_without_disk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Geometry from the block disk (512-byte sectors in "size"), model from the
    controller or, for a multipath head, the subsystem; a namespace the kernel
    made no disk for (unsupported format) is listed with unknown geometry."""
    ctrl = FakeDevice("nvme0", "nvme", node="/dev/nvme0", model="Fast SSD ", serial=" S123",
                      firmware_rev="1.0", transport="pcie", address="0000:01:00.0")
    subsys = FakeDevice("nvme-subsys1", "nvme-subsystem", model="Shared SSD", serial="S9")
    ng0 = FakeDevice("ng0n1", "nvme-generic", parent=ctrl, node="/dev/ng0n1")
    ng0b = FakeDevice("ng0n2", "nvme-generic", parent=ctrl, node="/dev/ng0n2")
    ng1 = FakeDevice("ng1n1", "nvme-generic", parent=subsys, node="/dev/ng1n1")
    disks = {
        "nvme0n1": FakeDevice("nvme0n1", "block", parent=ctrl, nsid="1", size="2097152",
                              queue__logical_block_size="4096", queue__max_hw_sectors_kb="512",
                              queue__max_segments="127", queue__discard_max_hw_bytes="2147479552"),
        "nvme1n1": FakeDevice("nvme1n1", "block", parent=subsys, nsid="7", size="1000",
                              queue__logical_block_size="512"),
    }

    def from_name(_ctx: object, subsystem: str, name: str) -> FakeDevice:
        if subsystem == "block" and name in disks:
            return disks[name]
        raise pyudev.DeviceNotFoundByNameError(subsystem, name)

    monkeypatch.setattr(pyudev.Devices, "from_name", from_name)
    ctx = FakeContext([ctrl, subsys, ng1, ng0b, ng0, *disks.values()])
    a, b, c = list_namespaces(identify=False, context=ctx)

    assert (a.char_device, a.block_device, a.controller, a.nsid) == ("/dev/ng0n1", "nvme0n1", "nvme0", 1)
    assert (a.lba_size, a.capacity_bytes, a.capacity_blocks) == (4096, 1 << 30, 1 << 18)
    assert (a.max_hw_sectors_kb, a.max_segments, a.discard_max_hw_bytes) == (512, 127, 2147479552)
    assert (a.model, a.serial, a.firmware, a.identified, a.mdts) == ("Fast SSD", "S123", "1.0", False, None)

    assert (b.char_device, b.block_device, b.nsid, b.lba_size, b.capacity_bytes) == (
        "/dev/ng0n2", None, None, None, None)

    assert (c.char_device, c.block_device, c.controller, c.nsid) == ("/dev/ng1n1", "nvme1n1", None, 7)
    assert (c.lba_size, c.capacity_blocks, c.model) == (512, 1000, "Shared SSD")
    assert c.max_segments is None

    (only,) = list_controllers(identify=False, context=ctx)
    assert (only.name, only.device, only.transport, only.address) == ("nvme0", "/dev/nvme0", "pcie",
                                                                       "0000:01:00.0")
    assert [ns.char_device for ns in only.namespaces] == ["/dev/ng0n1", "/dev/ng0n2"]


def test_kernel_without_generic_char_devices_lists_namespaces_by_their_disk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux before 5.13 (Debian 11's 5.10) has no nvme-generic class: every namespace disk is listed with its
    block node as the node to open; partitions and hidden multipath paths (nvmeXcYnZ) are not namespaces."""
    ctrl = FakeDevice("nvme0", "nvme", node="/dev/nvme0", model="Old SSD", serial="S5", transport="pcie")
    disk = FakeDevice("nvme0n1", "block", parent=ctrl, node="/dev/nvme0n1", nsid="1", size="2097152",
                      queue__logical_block_size="512", queue__max_segments="33")
    disk2 = FakeDevice("nvme0n2", "block", parent=ctrl, node="/dev/nvme0n2", nsid="2", size="8",
                       queue__logical_block_size="4096")
    part = FakeDevice("nvme0n1p1", "block", parent=disk, node="/dev/nvme0n1p1", size="2048")
    hidden = FakeDevice("nvme0c0n1", "block", parent=ctrl, nsid="1", size="2097152")
    sda = FakeDevice("sda", "block", node="/dev/sda", size="8")

    def from_name(_ctx: object, subsystem: str, name: str) -> FakeDevice:
        raise pyudev.DeviceNotFoundByNameError(subsystem, name)

    monkeypatch.setattr(pyudev.Devices, "from_name", from_name)
    ctx = FakeContext([ctrl, sda, hidden, part, disk2, disk])
    a, b = list_namespaces(identify=False, context=ctx)
    assert (a.char_device, a.node, a.block_device, a.controller, a.nsid) == (
        "/dev/nvme0n1", "block", "nvme0n1", "nvme0", 1)
    assert (a.lba_size, a.capacity_bytes, a.max_segments, a.model, a.identified) == (
        512, 1 << 30, 33, "Old SSD", False)
    assert (b.char_device, b.node, b.nsid, b.lba_size, b.capacity_blocks) == ("/dev/nvme0n2", "block", 2, 4096, 1)
    (only,) = list_controllers(identify=False, context=ctx)
    assert [ns.char_device for ns in only.namespaces] == ["/dev/nvme0n1", "/dev/nvme0n2"]


def test_a_disk_with_a_generic_node_is_listed_once_by_that_node(monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = FakeDevice("nvme0", "nvme", node="/dev/nvme0")
    disk = FakeDevice("nvme0n1", "block", parent=ctrl, node="/dev/nvme0n1", nsid="1")
    ng = FakeDevice("ng0n1", "nvme-generic", parent=ctrl, node="/dev/ng0n1")
    monkeypatch.setattr(pyudev.Devices, "from_name", lambda _c, _s, name: disk)
    (ns,) = list_namespaces(identify=False, context=FakeContext([disk, ng, ctrl]))
    assert (ns.char_device, ns.node, ns.block_device) == ("/dev/ng0n1", "generic", "nvme0n1")


@pytest.mark.root
def test_the_nvme_backend_refuses_a_block_device_that_is_no_namespace(loop_device: str) -> None:
    """A block node is taken only as an NVMe namespace's (kernels without /dev/ngXnY); the VM covers that."""
    from bladed.io import BladedIOError, open_device

    with pytest.raises(BladedIOError, match=r"\(loop\d+\) is not an NVMe namespace \(want /dev/ngXnY, or "
                                            r"/dev/nvmeXnY before Linux 5\.13\)"):
        open_device("nvme", loop_device)
