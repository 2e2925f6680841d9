"""What the NVMe test VM was booted with, as run-in-nvme-vm.sh exports it to the guest."""

from __future__ import annotations

import os
from dataclasses import dataclass

NG_PATH = "/dev/ng0n1"
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
