"""The KPU store interface and what a store is handed: validated accesses and a channel's I/O means."""

from __future__ import annotations

import abc
import time
from typing import ClassVar, Protocol

from bladed.io import Engine, StagingBuffer
from bladed.protocol import ErrorCode, IOOp, RangeResult
from bladed.residency.planner import KPU, KVPath
from bladed.server.storage.gates import KPUGates

_DIRECT = KVPath.DIRECT


class ChannelIO(Protocol):
    """What a store uses of the channel serving a request: its ring, its staging slot, its index."""

    index: int
    engine: Engine
    slot: StagingBuffer


class Access:
    """One range of a request, checked against the session and bound to its KPU.

    Bytes ``[offset, offset + nbytes)`` of the KPU (its token rows back to back)
    and bytes ``[slot_offset, slot_offset + nbytes)`` of the channel's slot.
    """

    __slots__ = ("direct", "kpu", "nbytes", "ntokens", "offset", "op", "result", "slot_offset", "token_start",
                 "write")

    def __init__(self, op: IOOp, kpu: KPU, token_start: int, ntokens: int, offset: int, nbytes: int,
                 slot_offset: int) -> None:
        self.op = op
        self.write = op is IOOp.WRITE
        self.kpu = kpu
        self.direct = kpu.path is _DIRECT
        self.token_start = token_start
        self.ntokens = ntokens
        self.offset = offset
        self.nbytes = nbytes
        self.slot_offset = slot_offset
        self.result = RangeResult()

    def __repr__(self) -> str:
        return (f"<Access {self.op.name.lower()} {self.kpu.name} tokens {self.token_start}+{self.ntokens} "
                f"slot {self.slot_offset} {self.result}>")

    def fail(self, code: ErrorCode, message: str) -> None:
        self.result.error = code
        self.result.message = message

    def served(self, path: KVPath, started_ns: int, hit_bytes: int | None = None) -> None:
        r = self.result
        r.path = path.value
        r.nbytes = self.nbytes
        r.started_ns = started_ns
        r.finished_ns = time.monotonic_ns()
        r.service_ns = r.finished_ns - started_ns
        r.hit_bytes = hit_bytes


class KPUStore(abc.ABC):
    """A set of KPUs on one I/O path, with everything that path needs to serve them."""

    path: ClassVar[KVPath]

    @abc.abstractmethod
    def holds(self, tensor_id: int) -> bool:
        """Is this KPU in this store?"""

    @abc.abstractmethod
    def run(self, ch: ChannelIO, accesses: list[Access]) -> None:
        """Serve ``accesses`` (all of them KPUs of this store) on ``ch``; fill in each one's result.

        Never raises for what one access did wrong: that access's result says so.
        """

    @abc.abstractmethod
    def offer_gate(self, kpu: KPU, gates: KPUGates) -> bool:
        """Open the lane's gate of ``kpu`` (one of this store's) if the lane may serve it now; True once no
        more tries are needed (the gate opened, or this store's KPU can never be served by the lane)."""


__all__ = ["Access", "ChannelIO", "KPUStore"]
