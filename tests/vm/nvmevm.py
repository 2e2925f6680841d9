"""What the NVMe test VM was booted with, as run-in-nvme-vm.sh exports it to the guest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def ns_name(nsid: int, controller: str = "nvme0") -> str:
    """The kernel's block name (``nvme0n2``) of namespace ``nsid`` on ``controller``.

    The Y of ``nvme0nY`` / ``ng0nY`` is the order the kernel found the
    namespace in, not its NSID: Linux 6.12 scans a controller's namespaces
    concurrently, so with two namespaces ``ng0n1`` is NSID 2 on some boots.
    Outside the VM (no such namespace) this is ``nvme0n<nsid>``.
    """
    for d in sorted(Path("/sys/block").glob(f"{controller}n*")):
        try:
            if int((d / "nsid").read_text()) == nsid:
                return d.name
        except (OSError, ValueError):
            continue
    return f"{controller}n{nsid}"


#: whether the guest kernel makes NVMe generic char devices /dev/ngXnY (5.13+; not Debian 11's 5.10)
GENERIC_NODES = os.path.isdir("/sys/class/nvme-generic")


def ng_path(nsid: int, controller: str = "nvme0") -> str:
    """The node the NVMe backend opens for namespace ``nsid``: its generic char device
    (``/dev/ng0nY``), or its block node (``/dev/nvme0nY``) on a kernel without generic nodes."""
    name = ns_name(nsid, controller)
    if not GENERIC_NODES:
        return f"/dev/{name}"
    return f"/dev/ng{controller[4:]}n{name[len(controller) + 1:]}"


#: namespace 1, the one the tests use (NSID 2 may be the faulty one, see run-in-nvme-vm.sh --faulty-sector)
NS_NAME = ns_name(1)
NG_PATH = ng_path(1)
QEMU_DEFAULT_MDTS = 7      # QEMU 7.2's nvme device default (run-in-nvme-vm.sh without --mdts)


@dataclass(frozen=True)
class VMConfig:
    lba_size: int
    mdts: int               # NVMe MDTS field: max transfer = 4 KiB * 2^mdts (0 = no limit)
    namespaces: int
    ns_bytes: int | None    # None: a harness that does not export NVMEVM_NS_BYTES

    @property
    def mdts_bytes(self) -> int:
        return 0 if self.mdts == 0 else 4096 << self.mdts

    @classmethod
    def from_env(cls) -> VMConfig:
        env = os.environ
        size = env.get("NVMEVM_NS_BYTES", "")
        return cls(
            lba_size=int(env.get("NVMEVM_LBA") or 4096),
            mdts=int(env.get("NVMEVM_MDTS") or QEMU_DEFAULT_MDTS),
            namespaces=int(env.get("NVMEVM_NAMESPACES") or 1),
            ns_bytes=int(size) if size else None,
        )
