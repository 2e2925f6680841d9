"""What a process without capabilities may do with an NVMe namespace's char
device it holds open read-write: the capabilities bladed.service needs on each
kernel (docs/operations.md, "Run under systemd").

Linux 6.2 (nvme_cmd_allowed()) lets such a process send Identify Namespace /
Controller and the I/O commands whose effects the controller reports (read,
write, Dataset Management, Write Zeroes); before 6.2 every passthrough command
needs CAP_SYS_ADMIN, whatever the file's mode.  Runs in the busybox-init
configurations: Debian 12's 6.1 and 6.12 kernels.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

import pytest
from nvmevm import NG_PATH
from systemdvm import UNPRIVILEGED_PASSTHROUGH

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import forked_as

from bladed.io.nvme import CNS_CONTROLLER, CNS_NAMESPACE, NvmeDevice, identify
from bladed.io.uring import Op, Ring, StagingBuffer, Transfer
from bladed.sizes import PAGE_SIZE

NOBODY = 65534


def _as_nobody(dev: NvmeDevice) -> dict[str, Any]:
    """Identify, then read LBA 0 and write it back, from a forked child with no uid 0 and no capabilities."""

    def body(out: dict[str, Any]) -> None:
        with open("/proc/self/status") as f:
            out["cap_eff"] = next(ln.split()[1] for ln in f if ln.startswith("CapEff:"))
        for name, cns, nsid in (("identify_ns", CNS_NAMESPACE, dev.nsid), ("identify_ctrl", CNS_CONTROLLER, 0)):
            try:
                identify(dev.fd, nsid, cns)
                out[name] = "ok"
            except OSError as e:
                out[name] = e.errno
        with StagingBuffer(PAGE_SIZE) as buf, Ring(2, big_sqe=True) as ring:
            target = dev.make_target()
            for op in (Op.READ, Op.WRITE):        # the write puts back what the read got
                x = Transfer(target, op, 0, dev.lba_size, buf.address, (buf, target))
                ring.run([x])
                err = x.error()
                out[op.name.lower()] = "ok" if err is None else getattr(err, "errno", repr(err))
                if err is not None:
                    break

    return forked_as(NOBODY, body)


@pytest.mark.kernel_feature("nvme_generic_chardev", reason="this is what /dev/ngXnY lets a user do")
def test_passthrough_without_capabilities() -> None:
    dev = NvmeDevice(NG_PATH)          # opened read-write by root, as systemd hands bladed its device
    try:
        got = _as_nobody(dev)
    finally:
        dev.close()
    assert "exception" not in got, got
    assert int(got["cap_eff"], 16) == 0
    if UNPRIVILEGED_PASSTHROUGH:
        assert got == {"cap_eff": got["cap_eff"], "identify_ns": "ok", "identify_ctrl": "ok", "read": "ok",
                       "write": "ok"}, got
    else:
        # EACCES for every command: NVMe passthrough on 6.1 needs CAP_SYS_ADMIN (cap-sys-admin.conf)
        assert (got["identify_ns"], got["identify_ctrl"], got["read"]) == (errno.EACCES,) * 3, got
