"""LBA extents: the region allocator shared by sessions, and the per-session
tensor -> LBA map of paper Eq. 3-6 with the index translation of Algorithm 2.

The configured region ``[start_lba, start_lba + nblocks)`` of the namespace
(or partition, or store file) is handed out one contiguous run per session
(:class:`ExtentAllocator`).  Inside a session's run, the direct-path KPUs are
laid out back to back in tensor order (:class:`ExtentMap`), so that a decode
step, which reads K0 V0 K1 V1 ..., is one ascending LBA stream.

This module does no I/O: TRIM on teardown is the caller's callback (the
daemon passes its engine's ``discard``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bladed.residency.planner import KPU, KVPath, Plan

log = logging.getLogger(__name__)


class RegionFullError(Exception):
    """No free run of the configured LBA region is large enough for a request."""

    def __init__(self, requested: int, free_blocks: int, largest_free: int, total_blocks: int,
                 lba_size: int | None = None) -> None:
        self.requested = requested
        self.free_blocks = free_blocks
        self.largest_free = largest_free
        self.total_blocks = total_blocks
        unit = f" ({requested * lba_size / 2**20:.1f} MiB)" if lba_size else ""
        if requested > free_blocks:
            why = f"only {free_blocks} of {total_blocks} blocks are free"
        else:
            why = (f"{free_blocks} blocks are free but the largest contiguous run is {largest_free} "
                   f"(the region is fragmented by live sessions)")
        super().__init__(f"KV region full: a session needs {requested} contiguous blocks{unit}, {why}; "
                         f"close sessions or configure a larger region")


class TranslationError(ValueError):
    """A tensor index cannot be turned into one LBA request."""


class IndexOutOfRangeError(TranslationError, IndexError):
    """The index, or the source box it anchors, lies outside the target tensor."""


class MisalignedRequestError(TranslationError):
    """The request would start or end inside a logical block."""


@dataclass(frozen=True)
class Extent:
    """A contiguous run of logical blocks ``[start, start + nblocks)`` owned by one session."""

    start: int
    nblocks: int
    owner: Hashable = None

    @property
    def end(self) -> int:
        return self.start + self.nblocks

    def __contains__(self, lba: object) -> bool:
        return isinstance(lba, int) and self.start <= lba < self.end


TrimFn = Callable[[int, int], object]


class ExtentAllocator:
    """Hands out contiguous runs of a fixed LBA region; thread-safe.

    Best fit (the smallest free run that holds the request, lowest address on
    ties), so large sessions keep finding room.  Freed runs are merged with
    their free neighbours immediately: once every session has closed, the free
    list is the whole region again, whatever the order of opens and closes.
    """

    def __init__(self, start_lba: int, nblocks: int, *, lba_size: int | None = None) -> None:
        for name, v in (("start_lba", start_lba), ("nblocks", nblocks)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if start_lba < 0:
            raise ValueError(f"start_lba must be >= 0, got {start_lba}")
        if nblocks <= 0:
            raise ValueError(f"the region must have at least one block, got {nblocks}")
        self.start_lba = start_lba
        self.nblocks = nblocks
        self.lba_size = lba_size
        self._lock = threading.Lock()
        self._free_starts: list[int] = [start_lba]
        self._free: dict[int, int] = {start_lba: nblocks}
        self._used: dict[int, Extent] = {}
        self.trim_failures = 0

    @property
    def end_lba(self) -> int:
        return self.start_lba + self.nblocks

    # -- queries -----------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        with self._lock:
            return sum(e.nblocks for e in self._used.values())

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return sum(self._free.values())

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max(self._free.values(), default=0)

    @property
    def extents(self) -> list[Extent]:
        """Live extents, by start LBA."""
        with self._lock:
            return [self._used[s] for s in sorted(self._used)]

    @property
    def free_runs(self) -> list[tuple[int, int]]:
        """Free runs ``(start, nblocks)``, by start LBA."""
        with self._lock:
            return [(s, self._free[s]) for s in self._free_starts]

    # -- allocation ----------------------------------------------------------
    def allocate(self, nblocks: int, owner: Hashable = None) -> Extent:
        """One contiguous run of ``nblocks`` blocks; :class:`RegionFullError` if none is free."""
        if isinstance(nblocks, bool) or not isinstance(nblocks, int) or nblocks <= 0:
            raise ValueError(f"an extent needs a positive number of blocks, got {nblocks!r}")
        with self._lock:
            best: int | None = None
            for s in self._free_starts:
                n = self._free[s]
                if n >= nblocks and (best is None or n < self._free[best]):
                    best = s
                    if n == nblocks:
                        break
            if best is None:
                raise RegionFullError(nblocks, sum(self._free.values()), max(self._free.values(), default=0),
                                      self.nblocks, self.lba_size)
            self._take(best, nblocks)
            ext = Extent(best, nblocks, owner)
            self._used[best] = ext
            return ext

    def reserve(self, start: int, nblocks: int, owner: Hashable = None) -> Extent:
        """Take exactly ``[start, start + nblocks)``, which must be free (ValueError otherwise).

        Used at start-up to keep blocks out of use that could not be scrubbed.
        """
        if isinstance(nblocks, bool) or not isinstance(nblocks, int) or nblocks <= 0:
            raise ValueError(f"an extent needs a positive number of blocks, got {nblocks!r}")
        with self._lock:
            i = bisect.bisect_right(self._free_starts, start) - 1
            run = self._free_starts[i] if i >= 0 else -1
            length = self._free.get(run, 0)
            if run < 0 or start + nblocks > run + length:
                raise ValueError(f"LBA [{start}, {start + nblocks}) is not free in the region "
                                 f"[{self.start_lba}, {self.end_lba})")
            if run < start:   # split the run: [run, start) stays free
                self._free[run] = start - run
                self._free[start] = run + length - start
                self._free_starts.insert(i + 1, start)
            self._take(start, nblocks)
            ext = Extent(start, nblocks, owner)
            self._used[start] = ext
            return ext

    def grow(self, extent: Extent, extra: int) -> Extent:
        """Extend a live extent in place by ``extra`` blocks (the run after it must be free)."""
        if extra <= 0:
            raise ValueError(f"grow by a positive number of blocks, got {extra}")
        with self._lock:
            self._check_live(extent)
            nxt = extent.end
            if self._free.get(nxt, 0) < extra:
                raise RegionFullError(extra, sum(self._free.values()), self._free.get(nxt, 0),
                                      self.nblocks, self.lba_size)
            self._take(nxt, extra)
            ext = Extent(extent.start, extent.nblocks + extra, extent.owner)
            self._used[extent.start] = ext
            return ext

    def free(self, extent: Extent, trim: TrimFn | None = None) -> None:
        """Give a run back, after ``trim(start_lba, nblocks)`` if given (TRIM / discard).

        A failing trim is logged and counted but the blocks are still freed: a
        new owner always writes before it reads.
        """
        with self._lock:
            self._check_live(extent)
        if trim is not None:
            try:
                trim(extent.start, extent.nblocks)
            except Exception:
                self.trim_failures += 1
                log.exception("TRIM of LBA [%d, %d) failed; freeing the blocks anyway", extent.start, extent.end)
        with self._lock:
            self._check_live(extent)
            del self._used[extent.start]
            self._give(extent.start, extent.nblocks)

    def _check_live(self, extent: Extent) -> None:
        live = self._used.get(extent.start)
        if live is None or live.nblocks != extent.nblocks:
            raise ValueError(f"extent [{extent.start}, {extent.end}) is not allocated here (double free?)")

    def _take(self, start: int, n: int) -> None:
        """Remove ``[start, start+n)`` from the head of the free run at ``start``."""
        run = self._free.pop(start)
        i = bisect.bisect_left(self._free_starts, start)
        del self._free_starts[i]
        if run > n:
            self._free[start + n] = run - n
            self._free_starts.insert(i, start + n)

    def _give(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # merge with the following run
        if i < len(self._free_starts) and self._free_starts[i] == start + n:
            n += self._free.pop(self._free_starts[i])
            del self._free_starts[i]
        # merge with the preceding run
        if i > 0:
            p = self._free_starts[i - 1]
            if p + self._free[p] == start:
                self._free[p] += n
                return
        self._free[start] = n
        self._free_starts.insert(i, start)

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (used by the tests)."""
        with self._lock:
            spans = sorted([(s, n, "free") for s, n in self._free.items()]
                           + [(e.start, e.nblocks, "used") for e in self._used.values()])
            assert self._free_starts == sorted(self._free), "free index out of order"
            pos = self.start_lba
            prev_kind = None
            for s, n, kind in spans:
                assert n > 0, f"empty run at {s}"
                assert s == pos, f"gap or overlap at LBA {pos} (next run starts at {s})"
                assert not (kind == "free" and prev_kind == "free"), f"adjacent free runs not merged at {s}"
                pos = s + n
                prev_kind = kind
            assert pos == self.end_lba, f"runs end at {pos}, region ends at {self.end_lba}"

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "start_lba": self.start_lba,
                "nblocks": self.nblocks,
                "used_blocks": sum(e.nblocks for e in self._used.values()),
                "free_blocks": sum(self._free.values()),
                "largest_free": max(self._free.values(), default=0),
                "extents": [{"start": e.start, "nblocks": e.nblocks, "owner": str(e.owner)}
                            for e in sorted(self._used.values(), key=lambda e: e.start)],
                "trim_failures": self.trim_failures,
            }


def _as_triple(name: str, v: Sequence[int]) -> tuple[int, int, int]:
    t = tuple(v)
    if len(t) != 3 or any(isinstance(x, bool) or not isinstance(x, int) for x in t):
        raise TranslationError(f"{name} must be three ints, got {v!r}")
    return t[0], t[1], t[2]


class ExtentMap:
    """Eq. 3-6: ``tensor id -> (lba_start, n_blocks)`` for a session's direct-path KPUs.

    Only the first ``lba_start`` is configured (the session extent's start);
    each next tensor begins where the previous ends.  The three invariants
    (alignment, disjointness, contiguity) hold by construction and are
    checked by :meth:`check`.  Entries are *bound* at construction and
    *materialized* (recorded as touched) on first lookup.
    """

    def __init__(self, plan: Plan, extent: Extent | None) -> None:
        self.plan = plan
        self.lba_size = plan.lba_size
        self._extent = extent
        self._entries: dict[int, tuple[int, int]] = {}
        self._kpus: dict[int, KPU] = {}
        self._materialized: set[int] = set()
        self._lock = threading.Lock()
        kpus = plan.direct_kpus()
        if kpus and extent is None:
            raise ValueError("the plan has NVMe-direct KPUs but no extent was given")
        self._next = extent.start if extent is not None else 0
        need = plan.extent_blocks
        if extent is not None and need > extent.nblocks:
            raise ValueError(f"the plan's direct KPUs need {need} blocks, the extent has {extent.nblocks}")
        for k in kpus:
            self._bind(k)

    def _bind(self, kpu: KPU) -> tuple[int, int]:
        if kpu.padded_bytes % self.lba_size:
            raise MisalignedRequestError(
                f"tensor {kpu.tensor_id}: {kpu.padded_bytes} bytes is not a multiple of the {self.lba_size}-byte LBA")
        nblocks = kpu.padded_bytes // self.lba_size               # Eq. 5
        start = self._next
        if self.extent is None or start + nblocks > self.extent.end:
            raise ValueError(f"tensor {kpu.tensor_id} ({nblocks} blocks) does not fit the session extent "
                             f"{self.extent!r}; allocate plan.reserve_blocks to allow demotions")
        if start < self.extent.start:   # only place() moves _next: an extent given any other way is a bug
            raise AssertionError(f"tensor {kpu.tensor_id} would start at LBA {start}, before {self.extent!r}")
        self._entries[kpu.tensor_id] = (start, nblocks)           # Eq. 3-4
        self._kpus[kpu.tensor_id] = kpu
        self._next = start + nblocks                              # Eq. 6
        return start, nblocks

    @property
    def extent(self) -> Extent | None:
        """The session's run of the region (None: no direct KPU yet, or released by :meth:`release`)."""
        return self._extent

    def place(self, extent: Extent) -> None:
        """Hand the map its extent: the first one sets where binding starts (Eq. 6's first ``lba_start``);
        a later one must be the same run grown in place, still holding every bound tensor.

        The one way an extent reaches a map after construction (a live demotion's new or grown room), so
        that no KPU is ever bound outside the extent the daemon reports for the session.
        """
        with self._lock:
            old = self._extent
            if old is None and not self._entries:
                self._next = extent.start
            elif old is None or extent.start != old.start or extent.end < self._next:
                raise ValueError(f"extent {extent!r} does not continue {old!r} (tensors bound up to LBA {self._next})")
            self._extent = extent

    @property
    def extent_start(self) -> int:
        """The first LBA of the extent (ValueError without one)."""
        ext = self._extent
        if ext is None:
            raise ValueError("the map has no extent")
        return ext.start

    def relocate(self, extent: Extent) -> None:
        """Move every bound tensor to the same offset in another extent (the session's room was moved
        because it could not grow in place); the caller has copied their bytes there."""
        with self._lock:
            old = self._extent
            if old is None:
                raise ValueError("the map has no extent to move")
            used = self._next - old.start
            if extent.nblocks < used:
                raise ValueError(f"extent {extent!r} cannot hold the {used} bound blocks of {old!r}")
            delta = extent.start - old.start
            self._entries = {t: (s + delta, n) for t, (s, n) in self._entries.items()}
            self._next += delta
            self._extent = extent

    def release(self) -> Extent | None:
        """Take the extent away (the session's teardown frees it); no tensor is bound after this."""
        with self._lock:
            ext, self._extent = self._extent, None
            return ext

    def blocks_short(self, nblocks: int) -> int:
        """Blocks the extent lacks for ``nblocks`` more after the last bound tensor (all of them if none)."""
        with self._lock:
            if self._extent is None:
                return nblocks
            return max(0, self._next + nblocks - self._extent.end)

    def add(self, kpu: KPU) -> tuple[int, int]:
        """Bind one more KPU after the last (a live demotion from Group 1)."""
        if kpu.path is not KVPath.DIRECT:
            raise ValueError(f"tensor {kpu.tensor_id} is not on the NVMe-direct path")
        with self._lock:
            if kpu.tensor_id in self._entries:
                raise ValueError(f"tensor {kpu.tensor_id} is already bound at LBA {self._entries[kpu.tensor_id][0]}")
            return self._bind(kpu)

    def lookup(self, tensor_id: int) -> tuple[int, int]:
        """``(lba_start, n_blocks)`` of a tensor (Eq. 3); the first lookup materializes it."""
        try:
            entry = self._entries[tensor_id]
        except KeyError:
            raise KeyError(f"tensor {tensor_id} is not on this session's NVMe-direct path") from None
        if tensor_id not in self._materialized:
            with self._lock:
                self._materialized.add(tensor_id)
        return entry

    def extent_of(self, tensor_id: int) -> tuple[int, int]:
        """Eq. 4: ``[lba_start, lba_start + n_blocks)``."""
        s, n = self.lookup(tensor_id)
        return s, s + n

    def __contains__(self, tensor_id: object) -> bool:
        return tensor_id in self._entries

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[int, tuple[int, int]]]:
        return list(self._entries.items())

    @property
    def materialized(self) -> frozenset[int]:
        return frozenset(self._materialized)

    def is_materialized(self, tensor_id: int) -> bool:
        """Has the tensor been looked up (used) since it was bound?"""
        return tensor_id in self._materialized

    @property
    def end_lba(self) -> int:
        """First LBA after the last bound tensor."""
        return self._next

    def translate(self, tensor_id: int, shape_tgt: Sequence[int], index: Sequence[int],
                  shape_src: Sequence[int], elem_bytes: int) -> tuple[int, int]:
        """Algorithm 2: the ``(slba*, req_bytes)`` of the box ``shape_src`` at ``index`` of a tensor.

        ``shape_tgt = (d0, d1, d2)`` is the tensor's full shape (tokens first),
        ``index = (i0, j0, k0)`` the box's first element, ``shape_src = (f0, f1, f2)``
        its extent.  The box must be one contiguous byte range of the tensor
        and start and end on block boundaries (always true for whole token
        rows when the alignment precondition of the paper's §IV-B holds, a token row being a whole
        number of LBAs; the extent store completes the
        edge LBAs of other ranges itself).
        """
        d0, d1, d2 = _as_triple("shape_tgt", shape_tgt)
        i0, j0, k0 = _as_triple("index", index)
        f0, f1, f2 = _as_triple("shape_src", shape_src)
        e = elem_bytes
        if isinstance(e, bool) or not isinstance(e, int) or e <= 0:
            raise TranslationError(f"elem_bytes must be a positive int, got {elem_bytes!r}")
        if min(d0, d1, d2) <= 0 or min(f0, f1, f2) <= 0:
            raise TranslationError(f"shapes must be positive: target {shape_tgt!r}, source {shape_src!r}")
        lba_start, nblocks = self.lookup(tensor_id)
        kpu = self._kpus[tensor_id]
        if d0 * d1 * d2 * e != kpu.nbytes:
            raise TranslationError(f"target shape {tuple(shape_tgt)} x {e} bytes = {d0 * d1 * d2 * e} bytes, "
                                   f"but tensor {tensor_id} holds {kpu.nbytes}")
        if min(i0, j0, k0) < 0 or i0 >= d0 or j0 >= d1 or k0 >= d2:
            raise IndexOutOfRangeError(f"index {tuple(index)} is outside the target shape {tuple(shape_tgt)}")
        if i0 + f0 > d0 or j0 + f1 > d1 or k0 + f2 > d2:
            raise IndexOutOfRangeError(
                f"source box {tuple(shape_src)} at {tuple(index)} reaches past the target shape {tuple(shape_tgt)}")
        if (f0 > 1 and (f1 != d1 or f2 != d2)) or (f1 > 1 and f2 != d2):
            raise TranslationError(
                f"source box {tuple(shape_src)} at {tuple(index)} is not one contiguous range of {tuple(shape_tgt)}")
        offset_elem = (i0 * d1 + j0) * d2 + k0                     # line 3
        offset_bytes = offset_elem * e                             # line 4
        req_bytes = f0 * f1 * f2 * e                               # line 6
        if offset_bytes % self.lba_size or req_bytes % self.lba_size:
            raise MisalignedRequestError(
                f"box {tuple(shape_src)} at {tuple(index)} of tensor {tensor_id} is bytes "
                f"[{offset_bytes}, {offset_bytes + req_bytes}), not aligned to the {self.lba_size}-byte LBA")
        slba = lba_start + offset_bytes // self.lba_size           # line 5
        assert slba + req_bytes // self.lba_size <= lba_start + nblocks
        return slba, req_bytes

    def check(self) -> None:
        """Assert the three invariants of the paper's §IV-B over the bound tensors: alignment, contiguity
        (Eq. 6), disjointness."""
        prev_end: int | None = None
        for tid, (start, n) in self._entries.items():
            kpu = self._kpus[tid]
            assert n * self.lba_size == kpu.padded_bytes, f"tensor {tid}: alignment (Eq. 5) broken"
            if prev_end is None:
                assert self.extent is not None and start == self.extent.start, "first tensor not at the extent start"
            else:
                assert start == prev_end, f"tensor {tid}: contiguity (Eq. 6) broken at {start} != {prev_end}"
            prev_end = start + n
        spans = sorted(self._entries.values())
        for (s1, n1), (s2, _) in itertools.pairwise(spans):
            assert s1 + n1 <= s2, "disjointness broken"
        if self.extent is not None and prev_end is not None:
            assert prev_end <= self.extent.end, "bound tensors overflow the session extent"
            assert all(s >= self.extent.start for s, _ in spans), "a tensor bound before the session extent"

    def to_dict(self) -> dict[str, Any]:
        return {
            "extent": None if self.extent is None else {"start": self.extent.start, "nblocks": self.extent.nblocks},
            "lba_size": self.lba_size,
            "tensors": {str(t): {"lba_start": s, "n_blocks": n, "materialized": t in self._materialized}
                        for t, (s, n) in self._entries.items()},
        }
