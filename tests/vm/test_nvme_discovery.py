"""bladed.io.discovery against the VM's real NVMe controller."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nvmevm import GENERIC_NODES, NG_PATH, NS_NAME, VMConfig, ng_path

from bladed.io.discovery import (
    NvmeNamespaceInfo,
    as_dict,
    find_namespace,
    list_controllers,
    list_namespaces,
)
from bladed.io.nvme import NvmeDevice

pytestmark = pytest.mark.nvme_vm

NOBODY = 65534


def _queue(name: str, attr: str) -> int:
    return int(Path(f"/sys/block/{name}/queue/{attr}").read_text())


def test_finds_every_namespace_of_the_vm(vm_config: VMConfig) -> None:
    found = list_namespaces()
    assert [ns.nsid for ns in found] == list(range(1, vm_config.namespaces + 1))
    assert [ns.char_device for ns in found] == [ng_path(k) for k in range(1, vm_config.namespaces + 1)]
    # before 5.13 (no /dev/ngXnY) each namespace is found by its disk, and its block node is what to open
    assert {ns.node for ns in found} == {"generic" if GENERIC_NODES else "block"}


def test_namespace_values_match_identify_and_sysfs(nvme_dev: NvmeDevice, vm_config: VMConfig) -> None:
    ns = find_namespace(NG_PATH)
    assert ns is not None
    assert ns.identified
    assert (ns.block_device, ns.controller, ns.nsid) == (NS_NAME, "nvme0", 1)
    assert ns.lba_size == vm_config.lba_size == nvme_dev.lba_size
    assert ns.capacity_blocks == nvme_dev.capacity_blocks
    assert ns.capacity_bytes == nvme_dev.capacity_bytes
    if vm_config.ns_bytes is not None:
        assert ns.capacity_bytes == vm_config.ns_bytes
    assert ns.mdts == vm_config.mdts and ns.mdts_bytes == vm_config.mdts_bytes
    assert ns.max_hw_sectors_kb == _queue(NS_NAME, "max_hw_sectors_kb")
    assert ns.max_segments == _queue(NS_NAME, "max_segments")
    assert ns.discard_max_hw_bytes == _queue(NS_NAME, "discard_max_hw_bytes")
    assert ns.serial == "nvmevm0" and ns.model == nvme_dev.identity.model
    assert json.loads(json.dumps(as_dict(ns)))["char_device"] == NG_PATH
    assert find_namespace(f"/dev/{NS_NAME}") == ns        # by its block node too


def test_controller_lists_its_namespaces(vm_config: VMConfig) -> None:
    (ctrl,) = list_controllers()
    assert (ctrl.name, ctrl.device, ctrl.transport) == ("nvme0", "/dev/nvme0", "pcie")
    assert ctrl.serial == "nvmevm0" and ctrl.model
    assert len(ctrl.namespaces) == vm_config.namespaces
    assert ctrl.namespaces[0] == find_namespace(NG_PATH)


def test_without_identify_geometry_still_comes_from_sysfs(nvme_dev: NvmeDevice) -> None:
    ns = find_namespace(NG_PATH, identify=False)
    assert ns is not None and not ns.identified
    assert ns.mdts is None and ns.mdts_bytes is None
    assert (ns.lba_size, ns.capacity_blocks, ns.nsid) == (nvme_dev.lba_size, nvme_dev.capacity_blocks, 1)


def test_unprivileged_user_gets_geometry_but_no_mdts(nvme_dev: NvmeDevice) -> None:
    """The namespace's /dev/ng0nY is root:root 0600: a user cannot open it for Identify, but
    discovery must still list the namespace from sysfs."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child: drop to nobody, report, exit
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            with os.fdopen(wfd, "w") as f:
                json.dump([as_dict(ns) for ns in list_namespaces()], f)
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "discovery as an unprivileged user failed"
    found = [NvmeNamespaceInfo(**d) for d in json.loads(text)]
    ns = next(n for n in found if n.char_device == NG_PATH)
    assert not ns.identified and ns.mdts is None
    assert (ns.lba_size, ns.capacity_blocks, ns.nsid) == (nvme_dev.lba_size, nvme_dev.capacity_blocks, 1)
    assert ns.serial == "nvmevm0"
