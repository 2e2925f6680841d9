"""Which KPUs of a session the lane may serve: one C gate per tensor id (``bd_kpu_gate``).

The lane (``bladed.server.wire.lane``) serves a request in C only if every KPU it
addresses has an open gate; it counts itself in on each gate for the time of
the copy or the transfer.  A gate opens on a plain page-cache KPU's file once
the file exists, or on a direct KPU's first LBA once the KPU is bound on the
extent (token rows of whole LBAs only), and closes for good when anything else
is to happen to the KPU: a demotion is
scheduled (:meth:`KPUGates.close`) and carried out after the lane's requests
on it drained (:meth:`KPUGates.drain`), or the session ends or is retained
(:meth:`KPUGates.seal`, under every channel lock, so no lane request runs).
Python decides when a gate opens (``DemotionState.open_lane_gates``); C only
obeys it.
"""

from __future__ import annotations

from bladed._uring import ffi, lib


class KPUGates:
    """The gates of one session's KPUs, by tensor id."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.array = ffi.new("struct bd_kpu_gate[]", max(1, count))
        for i in range(count):
            self.array[i].word = lib.BD_GATE_CLOSED
            self.array[i].fd = -1
        #: closed for good: nothing opens again (the session is closing or retained)
        self.sealed = False

    def is_open(self, tensor_id: int) -> bool:
        return not self.array[tensor_id].word & lib.BD_GATE_CLOSED

    def open(self, tensor_id: int, fd: int, base: int, nbytes: int) -> bool:
        """Let the lane serve the page-cache KPU from file ``fd`` mapped at ``base``; False if it is open or
        draining."""
        return not self.sealed and lib.bd_gate_open(ffi.addressof(self.array, tensor_id), lib.BD_PATH_PAGECACHE,
                                                    fd, base, nbytes) == 0

    def open_direct(self, tensor_id: int, slba: int, nbytes: int) -> bool:
        """Let the lane serve the direct KPU whose ``nbytes`` start at LBA ``slba`` of the session's device;
        False if it is open or draining."""
        return not self.sealed and lib.bd_gate_open(ffi.addressof(self.array, tensor_id), lib.BD_PATH_DIRECT,
                                                    -1, slba, nbytes) == 0

    def close(self, tensor_id: int) -> None:
        """New lane requests on the KPU go to Python (those in flight finish)."""
        lib.bd_gate_close(ffi.addressof(self.array, tensor_id))

    def drain(self, tensor_id: int) -> None:
        """Close, then wait until no lane request is on the KPU (the GIL released meanwhile)."""
        lib.bd_gate_drain(ffi.addressof(self.array, tensor_id))

    def seal(self) -> None:
        """Close every gate for good.  The caller holds every channel lock: no lane request is in flight."""
        self.sealed = True
        for i in range(self.count):
            lib.bd_gate_close(ffi.addressof(self.array, i))

    def filled(self, tensor_id: int) -> int:
        """Tokens ``[0, n)`` the lane wrote in the KPU (the general path's marks are ``DemotionState.filled``)."""
        return int(self.array[tensor_id].filled)


__all__ = ["KPUGates"]
