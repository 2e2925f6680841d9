"""A pool's slot table: which key each block slot holds, its state, generation, pins and use order, and the
index file that keeps the committed slots across restarts.  No storage I/O beyond the index file."""

from __future__ import annotations

import collections
import contextlib
import heapq
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

#: longest key a pool takes (vLLM's OffloadKey: a 32-byte block hash and a 4-byte KV group)
MAX_KEY_BYTES = 64
FREE, PENDING, READY = 0, 1, 2
MAGIC = b"bladedbk"
VERSION = 1
_HEADER = struct.Struct("<8sIIII")     # magic, version, capacity, kpus, record bytes
HEADER_BYTES = 64


def record_dtype(kpus: int) -> np.dtype:
    """One slot's record in the index file: state, key length, generation, last use, key, a crc per KPU."""
    return np.dtype([("state", "u1"), ("keylen", "u1"), ("pad", "u1", 6), ("gen", "<u8"), ("used", "<f8"),
                     ("key", "u1", MAX_KEY_BYTES), ("crc", "<u4", kpus)])


@dataclass
class Reserved:
    key: bytes
    slot: int
    gen: int


class SlotTable:
    """Slots by key under one lock; the index file is rewritten record by record as slots commit or go."""

    def __init__(self, capacity: int, kpus: int, path: str) -> None:
        self.capacity = capacity
        self.kpus = kpus
        self.path = path
        self.dtype = record_dtype(kpus)
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.gen = np.zeros(capacity, dtype=np.uint64)
        self.pins = np.zeros(capacity, dtype=np.int32)
        self.keys: list[bytes | None] = [None] * capacity
        self.by_key: dict[bytes, int] = {}
        #: committed slots, least recently used first
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._free = list(range(capacity))          # a heap: the lowest free slot first keeps stores contiguous
        #: pending slots by the connection that reserved them; pins by the connection holding them
        self.owner: dict[int, object] = {}
        self.pinned_by: dict[object, collections.Counter[int]] = {}
        self.lock = threading.Lock()
        self._fd = -1

    # -- the index file ------------------------------------------------------------------
    def open(self, *, fresh: bool) -> list[tuple[int, np.ndarray]]:
        """Open (``fresh``: create) the index file; the committed slots it lists, each with its crcs
        (ValueError where the file is not this pool's)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(self.path, flags, 0o600)
        size = HEADER_BYTES + self.capacity * self.dtype.itemsize
        if fresh:
            os.ftruncate(self._fd, size)
            os.pwrite(self._fd, _HEADER.pack(MAGIC, VERSION, self.capacity, self.kpus, self.dtype.itemsize), 0)
            os.fsync(self._fd)
            return []
        head = os.pread(self._fd, _HEADER.size, 0)
        if len(head) != _HEADER.size or _HEADER.unpack(head) != (MAGIC, VERSION, self.capacity, self.kpus,
                                                                 self.dtype.itemsize):
            raise ValueError(f"{self.path} is not the index of this pool")
        raw = os.pread(self._fd, size - HEADER_BYTES, HEADER_BYTES)
        if len(raw) != size - HEADER_BYTES:
            raise ValueError(f"{self.path} is short ({len(raw) + HEADER_BYTES} of {size} bytes)")
        recs = np.frombuffer(raw, dtype=self.dtype)
        out = []
        ready = np.flatnonzero(recs["state"] == READY)
        for s in sorted(ready.tolist(), key=lambda s: float(recs["used"][s])):
            r = recs[s]
            n = int(r["keylen"])
            if not 0 < n <= MAX_KEY_BYTES:
                continue
            key = bytes(r["key"][:n])
            if key in self.by_key:
                continue
            self._take(s)
            self.state[s], self.gen[s], self.keys[s] = READY, int(r["gen"]), key
            self.by_key[key] = s
            self.lru[s] = None
            out.append((s, np.array(r["crc"], dtype=np.uint32)))
        return out

    def _write(self, slot: int, crcs: np.ndarray | None) -> None:
        rec = np.zeros(1, dtype=self.dtype)
        key = self.keys[slot]
        if self.state[slot] == READY and key is not None and crcs is not None:
            rec["state"], rec["keylen"], rec["gen"], rec["used"] = READY, len(key), self.gen[slot], time.time()
            rec["key"][0, :len(key)] = np.frombuffer(key, dtype=np.uint8)
            rec["crc"][0] = crcs
        # a slot that is not committed is written as free: a crash never brings back a slot being rewritten
        os.pwrite(self._fd, rec.tobytes(), HEADER_BYTES + slot * self.dtype.itemsize)

    def flush(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)

    def close(self, *, remove: bool = False) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- slots ---------------------------------------------------------------------------
    def _take(self, slot: int) -> None:
        with contextlib.suppress(ValueError):
            self._free.remove(slot)
            heapq.heapify(self._free)

    def _release(self, slot: int) -> None:
        key = self.keys[slot]
        if key is not None and self.by_key.get(key) == slot:
            del self.by_key[key]
        self.keys[slot] = None
        self.state[slot] = FREE
        self.lru.pop(slot, None)
        self.owner.pop(slot, None)
        heapq.heappush(self._free, slot)

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """Per key: READY, PENDING or FREE (a miss)."""
        with self.lock:
            return [int(self.state[self.by_key[k]]) if k in self.by_key else FREE for k in keys]

    def reserve(self, keys: Iterable[bytes], owner: object) -> tuple[list[Reserved], list[bytes], int, list[int]]:
        """Slots for the keys not held yet: free ones, then the least recently used committed slots no load
        pins.  Returns (reserved, evicted keys, keys refused for want of a slot, evicted slots)."""
        out: list[Reserved] = []
        evicted: list[bytes] = []
        evicted_slots: list[int] = []
        refused = 0
        with self.lock:
            for k in keys:
                if k in self.by_key:
                    continue
                if self._free:
                    s = heapq.heappop(self._free)
                else:
                    s = next((v for v in self.lru if self.pins[v] == 0), -1)
                    if s < 0:
                        refused += 1
                        continue
                    old = self.keys[s]
                    assert old is not None
                    evicted.append(old)
                    evicted_slots.append(s)
                    del self.by_key[old]
                    del self.lru[s]
                    self.state[s] = FREE
                    self._write(s, None)
                g = secrets.randbits(63) or 1
                self.state[s], self.gen[s], self.keys[s] = PENDING, g, k
                self.by_key[k] = s
                self.owner[s] = owner
                out.append(Reserved(k, s, g))
        return out, evicted, refused, evicted_slots

    def commit(self, items: Iterable[tuple[int, int]], crcs_of: object) -> list[int]:
        """Make pending slots (slot, generation) loadable, with their crcs (``crcs_of(slot)``); the slots
        committed (others were aborted, or belong to another reservation)."""
        done = []
        with self.lock:
            for s, g in items:
                if 0 <= s < self.capacity and self.state[s] == PENDING and int(self.gen[s]) == g:
                    self.state[s] = READY
                    self.owner.pop(s, None)
                    self.lru[s] = None
                    self._write(s, crcs_of(s))      # type: ignore[operator]
                    done.append(s)
        return done

    def abort(self, items: Iterable[tuple[int, int]]) -> list[int]:
        """Free pending slots (slot, generation) never committed; the slots freed."""
        out = []
        with self.lock:
            for s, g in items:
                if 0 <= s < self.capacity and self.state[s] == PENDING and int(self.gen[s]) == g:
                    self._release(s)
                    out.append(s)
        return out

    def pin(self, keys: Iterable[bytes], owner: object) -> list[tuple[int, int] | None]:
        """Hold committed blocks against eviction until :meth:`unpin`; (slot, generation) or None per key."""
        out: list[tuple[int, int] | None] = []
        with self.lock:
            held = self.pinned_by.setdefault(owner, collections.Counter())
            for k in keys:
                s = self.by_key.get(k)
                if s is None or self.state[s] != READY:
                    out.append(None)
                    continue
                self.pins[s] += 1
                held[s] += 1
                self.lru.move_to_end(s)
                out.append((s, int(self.gen[s])))
        return out

    def unpin(self, items: Iterable[tuple[int, int]], owner: object) -> None:
        with self.lock:
            held = self.pinned_by.get(owner)
            for s, g in items:
                if held and held[s] > 0 and int(self.gen[s]) == g:
                    held[s] -= 1
                    self.pins[s] -= 1

    def verify(self, items: Iterable[tuple[int, int]]) -> list[bool]:
        """Whether each (slot, generation) is still that committed block."""
        with self.lock:
            return [bool(0 <= s < self.capacity and self.state[s] == READY and int(self.gen[s]) == g) for s, g in items]

    def touch(self, keys: Iterable[bytes]) -> None:
        with self.lock:
            for k in keys:
                s = self.by_key.get(k)
                if s is not None and s in self.lru:
                    self.lru.move_to_end(s)

    def drop(self, keys: Iterable[bytes] | None) -> tuple[list[bytes], list[int]]:
        """Evict committed blocks no load pins (every one with ``keys`` None); (keys, slots) evicted."""
        with self.lock:
            slots = list(self.lru) if keys is None else [self.by_key[k] for k in keys
                                                           if k in self.by_key and self.by_key[k] in self.lru]
            gone = [s for s in slots if self.pins[s] == 0]
            out = []
            for s in gone:
                k = self.keys[s]
                assert k is not None
                out.append(k)
                self._release(s)
                self._write(s, None)
        return out, gone

    def forget_owner(self, owner: object) -> list[int]:
        """A connection ended: its pins go, its pending slots are freed; the slots freed."""
        with self.lock:
            held = self.pinned_by.pop(owner, None)
            for s, n in (held or {}).items():
                self.pins[s] -= n
            pending = [s for s, o in self.owner.items() if o is owner]
            for s in pending:
                self._release(s)
        return pending

    def gauges(self) -> dict[str, int]:
        with self.lock:
            return {"capacity": self.capacity, "ready": len(self.lru), "pending": len(self.owner),
                    "pinned": int((self.pins > 0).sum())}


__all__ = ["FREE", "MAX_KEY_BYTES", "PENDING", "READY", "Reserved", "SlotTable"]
