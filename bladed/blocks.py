"""The client of a daemon's block pools: fixed-size KV blocks keyed by opaque hashes (docs/protocol.md, "Block
pools"; docs/vllm.md).

A pool is named by a :class:`PoolKey` (the model, its KV dtype, the block's shape) within the peer's scope.
:class:`PoolControl` asks the daemon about blocks (lookup, reserve slots, pin for a load, commit, ...) over a
control connection and needs no staging; :class:`PoolAttachment` is a :class:`bladed.client.Session` over
the pool's storage, whose staging slot moves pages of many blocks in batched requests (one per run of
consecutive slots, pipelined with :meth:`Session.submit_many`).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bladed.client import Client, OpResult, Session
from bladed.protocol import IOOp, IORange

#: a block slot and the generation of what it holds (a commit's): what reads and pins name
SlotGen = tuple[int, int]


@dataclass(frozen=True)
class PoolKey:
    """What tells one pool's blocks from another's (docs/protocol.md, "Block pools")."""

    model: str
    dtype: str
    #: pages per block (one per attention layer's KV tensor) and bytes per page
    pages: int
    page_bytes: int
    #: tokens per block (what a key covers)
    block_tokens: int
    #: the capacity asked for when the pool is made (the daemon caps it at blocks.max_bytes)
    capacity_bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "pages": self.pages, "page_bytes": self.page_bytes,
                "block_tokens": self.block_tokens, "capacity_bytes": self.capacity_bytes}


@dataclass
class Reservation:
    """Slots reserved for blocks to store: ``store`` (key, slot, generation), the keys evicted for them, and how
    many keys found no slot (every slot being read)."""

    store: list[tuple[bytes, int, int]]
    evicted: list[bytes]
    refused: int


class PoolControl:
    """The control side of one pool: the ``blocks`` op's actions over ``client``."""

    def __init__(self, client: Client, key: PoolKey) -> None:
        self.client = client
        self.key = key
        info = client.call("blocks", action="open", blocks=key.to_wire())
        self.info: dict[str, Any] = {k: v for k, v in info.items() if k not in ("id", "ok")}
        self.id: str = info["pool"]
        self.capacity: int = int(info["capacity"])

    def _call(self, action: str, **fields: Any) -> dict[str, Any]:
        return self.client.call("blocks", action=action, pool=self.id, **fields)

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Per key: ``"ready"`` (loadable), ``"pending"`` (being stored) or ``"miss"``."""
        return list(self._call("lookup", keys=[k.hex() for k in keys])["states"])

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        r = self._call("reserve", keys=[k.hex() for k in keys])
        return Reservation([(bytes.fromhex(k), int(s), int(g)) for k, s, g in r["store"]],
                           [bytes.fromhex(k) for k in r["evicted"]], int(r["refused"]))

    def commit(self, items: Iterable[SlotGen]) -> list[int]:
        """Make written slots loadable; the slots committed (the rest were not reserved so, or not written)."""
        return list(self._call("commit", blocks=[list(x) for x in items])["committed"])

    def abort(self, items: Iterable[SlotGen]) -> list[int]:
        """Free reserved slots that were never committed (no-op on committed ones)."""
        return list(self._call("abort", blocks=[list(x) for x in items])["aborted"])

    def pin(self, keys: Sequence[bytes]) -> list[SlotGen | None]:
        """Hold committed blocks against eviction for a load; (slot, generation) or None per key."""
        return [None if x is None else (int(x[0]), int(x[1]))
                for x in self._call("pin", keys=[k.hex() for k in keys])["blocks"]]

    def unpin(self, items: Iterable[SlotGen]) -> None:
        self._call("unpin", blocks=[list(x) for x in items])

    def verify(self, items: Iterable[SlotGen]) -> list[bool]:
        """Whether each (slot, generation) still holds that committed block (after reading it)."""
        return [bool(v) for v in self._call("verify", blocks=[list(x) for x in items])["valid"]]

    def touch(self, keys: Sequence[bytes]) -> None:
        self._call("touch", keys=[k.hex() for k in keys])

    def evict(self, keys: Sequence[bytes] | None = None) -> list[bytes]:
        """Drop committed blocks no load holds (all of them with ``keys`` None); the keys dropped."""
        fields: dict[str, Any] = {} if keys is None else {"keys": [k.hex() for k in keys]}
        return [bytes.fromhex(k) for k in self._call("evict", **fields)["evicted"]]

    def drop(self) -> None:
        """Remove the whole pool (no attachment may be open)."""
        self._call("drop_pool")


class PoolAttachment:
    """A session over one pool's storage with a staging slot of ``slot_blocks`` blocks per channel.

    The slot is laid out page-major: page ``p`` of the request's ``i``-th block at
    ``(p * slot_blocks + i) * page_bytes``, so a run of consecutive slots is one range per page.
    """

    def __init__(self, client: Client, key: PoolKey, *, slot_blocks: int, channels: int = 1,
                 pin: bool | None = False) -> None:
        self.client = client
        self.slot_blocks = slot_blocks
        kpus = 2 * ((key.pages + 1) // 2)
        slot_bytes = kpus * slot_blocks * key.page_bytes
        fd = os.memfd_create("bladed-blocks", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            reply = client.call("open_blocks", (fd,), blocks=key.to_wire(), channels=channels, slot_bytes=slot_bytes)
            try:
                mapping = mmap.mmap(fd, int(reply["layout"]["staging_bytes"]))
            except BaseException:
                client.call_async("close_session", session=reply["session"])
                raise
        finally:
            os.close(fd)
        self.session = Session(client, reply, mapping, pin)
        self.info: dict[str, Any] = reply["blocks"]
        self.pool_id: str = self.info["pool"]
        self.pages = key.pages
        self.page_bytes = key.page_bytes

    def slot(self, ch: int = 0) -> memoryview:
        return self.session.slot(ch)

    def requests(self, op: IOOp, slots: Sequence[int], *, runs: bool = True) -> list[list[IORange]]:
        """The batched requests that move the pages of ``slots`` (block ``i`` of the slot layout is
        ``slots[i]``): one request per run of consecutive slots (``runs`` False: per slot), one range per page."""
        out: list[list[IORange]] = []
        i = 0
        while i < len(slots):
            j = i + 1
            while runs and j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            ranges = [IORange(op, p, slots[i], j - i, (p * self.slot_blocks + i) * self.page_bytes)
                      for p in range(self.pages)]
            out += self.session.requests_of(ranges)
            i = j
        return out

    def move(self, op: IOOp, slots: Sequence[int], ch: int = 0, *, runs: bool = True) -> list[tuple[IORange, OpResult]]:
        """Write (``IOOp.WRITE``) or read the pages of ``slots`` between the slot and the pool, pipelined; each
        range with its result (a range that failed has its ``error``: a read's crc mismatch fails the range's
        whole run of slots, ``runs`` False names each slot alone)."""
        if len(slots) > self.slot_blocks:
            raise ValueError(f"{len(slots)} blocks do not fit a slot of {self.slot_blocks}")
        reqs = self.requests(op, slots, runs=runs)
        done = self.session.submit_many(ch, reqs, check=False)
        return [pair for rq, rs in zip(reqs, done, strict=True) for pair in zip(rq, rs, strict=True)]

    def close(self) -> None:
        self.session.close()


__all__ = ["PoolAttachment", "PoolControl", "PoolKey", "Reservation", "SlotGen"]
