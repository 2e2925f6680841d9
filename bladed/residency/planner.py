"""The KPU residency planner: paper Algorithm 1 and the four modes of Table III (the paper's
compared configurations: Baseline, CachePolicy-Only, NVMe-direct-Only, Dual-Blade).

Each KPU (one layer's K or V) is put in Group 1 (page-cache path, resident
within the budget) or Group 2 (beyond the budget).  Where Group 2 goes
depends on the mode:

=============  =====================  ========================================
mode           X                      Group 2
=============  =====================  ========================================
baseline       everything             (none: every KPU on the page-cache path)
cachepolicy    ``B_pc``               page-cache path, dropped after each use
direct         0                      NVMe-direct (so: every KPU)
dualblade      ``B_pc``               NVMe-direct
=============  =====================  ========================================

Admission is driven by a :class:`Ranker`: it lists *admission units* (tuples
of tensor ids) best first, and the planner admits units in that order while
their page-cache footprint fits in ``X``, stopping at the first one that
does not (a prefix, as in Algorithm 1).  The default :class:`LayerOrderRanker`
yields the pairs ``(K_i, V_i)`` in layer order, which is exactly
``n1 = min(floor(X / (2 S_kpu)), L)`` with layers ``1..n1`` in Group 1.

A :class:`Plan` names these by what they are: ``X`` is its
``group1_limit_bytes``, ``n1`` its ``group1_layers`` and ``B_pc`` (as granted
to the session) its ``budget_bytes``.

Layers are numbered from 0 here (the paper's layer ``i`` is our ``i - 1``);
tensor ids come from :func:`bladed.residency.geometry.tensor_id`
(``2 * layer + (kind == "v")``), which is also the order in which a decode
step reads them.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from bladed.residency.geometry import Geometry, check_lba_size, tensor_id, tensor_of
from bladed.sizes import PAGE_SIZE, align_up


class Mode(enum.StrEnum):
    """The configurations the paper compares (its Table III), selectable by name."""

    BASELINE = "baseline"          # all KV on the page-cache path (vanilla FlexLLMGen)
    CACHEPOLICY = "cachepolicy"    # X = B_pc; Group 2 on the page-cache path, dropped after use
    DIRECT = "direct"              # X = 0; all KV on the NVMe-direct path
    DUALBLADE = "dualblade"        # X = B_pc; Group 2 on the NVMe-direct path

    @classmethod
    def parse(cls, name: str | Mode) -> Mode:
        """A mode from its name or one of the paper's labels (``Dual-Blade``, ``NVMe-direct-Only``, ...)."""
        if isinstance(name, Mode):
            return name
        key = str(name).strip().lower().replace("_", "-")
        aliases = {
            "baseline": cls.BASELINE, "vanilla": cls.BASELINE,
            "cachepolicy": cls.CACHEPOLICY, "cachepolicy-only": cls.CACHEPOLICY, "cache-policy": cls.CACHEPOLICY,
            "direct": cls.DIRECT, "nvme-direct": cls.DIRECT, "nvme-direct-only": cls.DIRECT,
            "dualblade": cls.DUALBLADE, "dual-blade": cls.DUALBLADE,
        }
        try:
            return aliases[key]
        except KeyError:
            raise ValueError(
                f"unknown residency mode {name!r}: choose one of {', '.join(m.value for m in cls)}"
            ) from None


class KVPath(enum.StrEnum):
    """The I/O path a KPU is served on."""

    PAGECACHE = "pagecache"
    DIRECT = "direct"


@dataclass(frozen=True)
class KPU:
    """One KV Placement Unit: a layer's K or V tensor, and where it lives.

    ``nbytes`` is the dense size (``max_tokens * B*H*D*e``, the size of its
    page-cache file); ``padded_bytes`` is what it takes on an LBA extent: the
    same token rows back to back (the packed layout), rounded up to a whole
    LBA, so equal to ``nbytes`` when the §IV-B precondition holds (a token
    row is a whole number of LBAs) and less than one LBA more otherwise.
    """

    layer: int
    kind: str
    tensor_id: int
    group: int
    nbytes: int
    padded_bytes: int
    path: KVPath = KVPath.PAGECACHE
    drop_after_use: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("k", "v"):
            raise ValueError(f"KPU kind must be 'k' or 'v', got {self.kind!r}")
        if self.layer < 0:
            raise ValueError(f"KPU layer must be >= 0, got {self.layer}")
        if self.tensor_id != tensor_id(self.layer, self.kind):
            raise ValueError(f"KPU tensor id {self.tensor_id} does not match layer {self.layer} kind {self.kind}")
        if self.group not in (1, 2):
            raise ValueError(f"KPU group must be 1 or 2, got {self.group}")
        if self.padded_bytes < self.nbytes:
            raise ValueError(f"padded size {self.padded_bytes} is below the tensor size {self.nbytes}")

    @property
    def name(self) -> str:
        """``k3`` / ``v3``: a stable name (e.g. for page-cache files)."""
        return f"{self.kind}{self.layer}"

    @property
    def pagecache_bytes(self) -> int:
        """Page-cache footprint of this KPU's file (whole pages)."""
        return align_up(self.nbytes, PAGE_SIZE)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "kind": self.kind, "tensor_id": self.tensor_id, "group": self.group,
                "path": self.path.value, "drop_after_use": self.drop_after_use,
                "nbytes": self.nbytes, "padded_bytes": self.padded_bytes}


# -- rankers -------------------------------------------------------------------

@runtime_checkable
class Ranker(Protocol):
    """Orders KPUs for admission to the page-cache path (paper §IV-A: "a ranker can drive X").

    ``units`` returns admission units, best first; every tensor id
    ``0 .. 2L-1`` must appear in exactly one unit.  A unit is admitted whole
    or not at all, and admission stops at the first unit that does not fit.
    """

    name: str

    def units(self, geometry: Geometry) -> Sequence[tuple[int, ...]]: ...


class LayerOrderRanker:
    """The paper's default: whole layers (K and V together) in layer order."""

    name = "layer-order"

    def units(self, geometry: Geometry) -> Sequence[tuple[int, ...]]:
        return [(tensor_id(i, "k"), tensor_id(i, "v")) for i in range(geometry.layers)]


class KpuFillRanker:
    """Layer order, but one KPU at a time, so the remainder of ``X`` is not wasted.

    Algorithm 1 admits K/V *pairs*: up to ``2 S_kpu - 1`` bytes of the budget
    stay unused (for OPT-6.7B, B=32, 544 tokens: up to 272 MiB).  This ranker
    also admits ``K`` of the next layer when one more KPU fits, so Group 1
    holds ``floor(X / S_kpu)`` KPUs instead of ``2 floor(X / 2 S_kpu)``: one
    more resident KPU whenever ``X mod 2 S_kpu >= S_kpu``, i.e. a larger
    fraction of every decode step's reads served from DRAM.  K is preferred
    over V because attention reads K first (Q K^T before the V product).
    """

    name = "kpu-fill"

    def units(self, geometry: Geometry) -> Sequence[tuple[int, ...]]:
        return [(t,) for t in range(2 * geometry.layers)]


RANKERS: dict[str, type[LayerOrderRanker] | type[KpuFillRanker]] = {
    LayerOrderRanker.name: LayerOrderRanker,
    KpuFillRanker.name: KpuFillRanker,
}


def get_ranker(name: str | Ranker | None) -> Ranker:
    """A ranker by name (``layer-order``, ``kpu-fill``), or the default for None."""
    if name is None:
        return LayerOrderRanker()
    if isinstance(name, str):
        try:
            return RANKERS[name]()
        except KeyError:
            raise ValueError(f"unknown ranker {name!r}: choose one of {', '.join(RANKERS)}") from None
    if not isinstance(name, Ranker):
        raise TypeError(f"ranker must be a name or have .name and .units(geometry), got {name!r}")
    return name


def _checked_units(ranker: Ranker, geometry: Geometry) -> list[tuple[int, ...]]:
    units = [tuple(int(t) for t in u) for u in ranker.units(geometry)]
    seen: list[int] = [t for u in units for t in u]
    if sorted(seen) != list(range(2 * geometry.layers)) or any(not u for u in units):
        raise ValueError(
            f"ranker {ranker.name!r} must list every tensor id 0..{2 * geometry.layers - 1} exactly once "
            f"in non-empty units; got {units!r}"
        )
    return units


# -- plans ---------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Where every KPU of one session lives (the output of Algorithm 1)."""

    geometry: Geometry
    mode: Mode
    group1_limit_bytes: int        # the knob X actually used: page-cache bytes Group 1 may fill (Algorithm 1)
    group1_layers: int             # layers with both K and V in Group 1 (Algorithm 1's n1)
    kpus: tuple[KPU, ...]          # by tensor id
    lba_size: int
    padding_bytes: int             # bytes of padding on the LBA extent (direct-path KPUs' last LBAs)
    budget_bytes: int = 0          # the page-cache budget granted to the session: its share of B_pc (Eq. 2)
    ranker: str = LayerOrderRanker.name
    _by_id: dict[int, KPU] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {k.tensor_id: k for k in self.kpus})

    def group1(self) -> tuple[KPU, ...]:
        """KPUs admitted to the page-cache path within the budget (kept resident)."""
        return tuple(k for k in self.kpus if k.group == 1)

    def group2(self) -> tuple[KPU, ...]:
        """KPUs beyond the budget (NVMe-direct, or page cache + drop in ``cachepolicy``)."""
        return tuple(k for k in self.kpus if k.group == 2)

    def direct_kpus(self) -> tuple[KPU, ...]:
        """KPUs that need LBA extents: Group 2 in ``direct``/``dualblade``, none otherwise."""
        return tuple(k for k in self.kpus if k.path is KVPath.DIRECT)

    def pagecache_kpus(self) -> tuple[KPU, ...]:
        """KPUs served through page-cache files (Group 1, plus Group 2 in ``baseline``/``cachepolicy``)."""
        return tuple(k for k in self.kpus if k.path is KVPath.PAGECACHE)

    def kpu(self, tensor_id: int) -> KPU:
        try:
            return self._by_id[tensor_id]
        except KeyError:
            raise KeyError(f"tensor id {tensor_id} is not in this plan (0..{len(self.kpus) - 1})") from None

    @property
    def group1_bytes(self) -> int:
        """Page-cache footprint the plan keeps resident (what it charges to ``B_pc``)."""
        return sum(k.pagecache_bytes for k in self.kpus if k.path is KVPath.PAGECACHE and not k.drop_after_use)

    @property
    def direct_bytes(self) -> int:
        return sum(k.padded_bytes for k in self.direct_kpus())

    @property
    def extent_blocks(self) -> int:
        """LBA blocks the direct-path KPUs need (one contiguous run)."""
        return self.direct_bytes // self.lba_size

    @property
    def reserve_blocks(self) -> int:
        """Blocks for every KPU of the session: reserve this many if live demotions must always fit."""
        if self.mode in (Mode.BASELINE, Mode.CACHEPOLICY):
            return 0
        return sum(k.padded_bytes for k in self.kpus) // self.lba_size

    @property
    def aligned(self) -> bool:
        """The §IV-B precondition: a token row is a whole number of LBAs, so every token range of a
        KPU is whole LBAs (Algorithm 2 applies as is; otherwise the extent keeps rows packed and the
        daemon completes the edge LBAs: ``bladed.server.storage.extent_store``)."""
        return self.geometry.aligned(self.lba_size)

    def hit_fraction_bound(self) -> float:
        """Fraction of a decode step's read bytes that the plan serves from resident page cache."""
        total = sum(k.nbytes for k in self.kpus)
        resident = sum(k.nbytes for k in self.kpus if k.group == 1 and self.mode is not Mode.BASELINE)
        return resident / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        g1 = self.group1()
        return {
            "mode": self.mode.value,
            "ranker": self.ranker,
            "geometry": self.geometry.to_dict(),
            "budget_bytes": self.budget_bytes,
            "group1_limit_bytes": self.group1_limit_bytes,
            "group1_layers": self.group1_layers,
            "lba_size": self.lba_size,
            "aligned": self.aligned,
            "padding_bytes": self.padding_bytes,
            "group1": [k.tensor_id for k in g1],
            "group2": [k.tensor_id for k in self.group2()],
            "group1_bytes": self.group1_bytes,
            "direct_bytes": self.direct_bytes,
            "extent_blocks": self.extent_blocks,
            "reserve_blocks": self.reserve_blocks,
            "kpus": [k.to_dict() for k in self.kpus],
        }


def whole_layers(tensor_ids: Iterable[int], layers: int) -> int:
    """How many layers have both K and V among ``tensor_ids`` (Algorithm 1's ``n1`` for Group 1)."""
    ids = set(tensor_ids)
    return sum(1 for i in range(layers) if tensor_id(i, "k") in ids and tensor_id(i, "v") in ids)


def _admit(units: Iterable[tuple[int, ...]], limit_bytes: int, unit_bytes: int) -> set[int]:
    admitted: set[int] = set()
    used = 0
    for unit in units:
        cost = len(unit) * unit_bytes
        if used + cost > limit_bytes:
            break
        used += cost
        admitted.update(unit)
    return admitted


def plan_session(geometry: Geometry, mode: Mode | str, budget_bytes: int, lba_size: int,
                 ranker: Ranker | str | None = None, *, group1_limit_bytes: int | None = None) -> Plan:
    """Algorithm 1: split a session's KPUs between the page-cache and the NVMe-direct path.

    ``budget_bytes`` is ``B_pc`` (Eq. 2) as granted to this session; ``group1_limit_bytes``
    sets the knob ``X`` explicitly (it must lie in ``[0, budget_bytes]``; default
    ``B_pc`` for ``cachepolicy``/``dualblade``; ``direct`` fixes X = 0 and
    ``baseline`` admits everything).
    """
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    mode = Mode.parse(mode)
    lba_size = check_lba_size(lba_size)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"page-cache budget must be a non-negative int, got {budget_bytes!r}")
    rk = get_ranker(ranker)
    units = _checked_units(rk, geometry)

    unit_bytes = align_up(geometry.kpu_bytes, PAGE_SIZE)   # S_kpu as the page cache holds it
    if mode is Mode.BASELINE or mode is Mode.DIRECT:
        if group1_limit_bytes is not None:
            raise ValueError(f"mode {mode.value!r} fixes X; do not pass group1_limit_bytes")
        x = 2 * geometry.layers * unit_bytes if mode is Mode.BASELINE else 0
    else:
        x = budget_bytes if group1_limit_bytes is None else group1_limit_bytes
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= budget_bytes:
            raise ValueError(f"group1_limit_bytes (X) must be an int in [0, budget_bytes={budget_bytes}], got {x!r}")
    admitted = _admit(units, x, unit_bytes)

    padded = align_up(geometry.kpu_bytes, lba_size)   # the packed layout: rows back to back, whole LBAs
    kpus = []
    for t in range(2 * geometry.layers):
        group = 1 if t in admitted else 2
        on_pc = group == 1 or mode in (Mode.BASELINE, Mode.CACHEPOLICY)
        path = KVPath.PAGECACHE if on_pc else KVPath.DIRECT
        layer, kind = tensor_of(t)
        kpus.append(KPU(layer=layer, kind=kind, tensor_id=t, group=group, nbytes=geometry.kpu_bytes,
                        padded_bytes=padded, path=path,
                        drop_after_use=(mode is Mode.CACHEPOLICY and group == 2)))
    n1 = whole_layers(admitted, geometry.layers)
    padding = sum(k.padded_bytes - k.nbytes for k in kpus if k.path is KVPath.DIRECT)
    return Plan(geometry=geometry, mode=mode, group1_limit_bytes=x, group1_layers=n1, kpus=tuple(kpus),
                lba_size=lba_size, padding_bytes=padding, budget_bytes=budget_bytes, ranker=rk.name)


# -- re-planning ---------------------------------------------------------------

@dataclass(frozen=True)
class Replan:
    """What a live session does at the next decode-step boundary after the budget shrank.

    ``demoted`` are KPUs that move from Group 1 (page cache) to Group 2, as
    they appear in ``new``.  Live sessions are never promoted: growth of the
    budget goes to new sessions.
    """

    old: Plan
    new: Plan
    demoted: tuple[KPU, ...]

    @property
    def changed(self) -> bool:
        return bool(self.demoted)

    def move_bytes(self, tokens_filled: int) -> int:
        """Bytes to copy for the demotions when ``tokens_filled`` tokens of each KPU hold data."""
        if not 0 <= tokens_filled <= self.old.geometry.max_tokens:
            raise ValueError(f"tokens_filled must be in [0, {self.old.geometry.max_tokens}], got {tokens_filled}")
        return len(self.demoted) * tokens_filled * self.old.geometry.token_bytes


def replan(plan: Plan, budget_bytes: int, ranker: Ranker | str | None = None) -> Replan:
    """Re-plan a live session for a smaller page-cache grant.

    Only whole KPUs move, only from Group 1 to Group 2, and only as far as
    needed: the new Group 1 is the ranker's admission prefix for
    ``X = min(plan.group1_limit_bytes, budget_bytes)``, intersected with the old Group 1.
    ``baseline`` and ``direct`` plans never change.  In ``dualblade`` demoted
    KPUs go to the NVMe-direct path (append them to the session's extent map);
    in ``cachepolicy`` they stay on the page-cache path and are dropped after use.
    """
    if plan.mode in (Mode.BASELINE, Mode.DIRECT) or budget_bytes >= plan.group1_bytes:
        return Replan(old=plan, new=plan, demoted=())
    rk = get_ranker(plan.ranker if ranker is None else ranker)
    target = plan_session(plan.geometry, plan.mode, max(0, budget_bytes), plan.lba_size, rk,
                          group1_limit_bytes=min(plan.group1_limit_bytes, max(0, budget_bytes)))
    keep = {k.tensor_id for k in target.group1()} & {k.tensor_id for k in plan.group1()}
    kpus = []
    demoted = []
    for k in plan.kpus:
        if k.group == 1 and k.tensor_id not in keep:
            nk = replace(k, group=2, path=KVPath.DIRECT if plan.mode is Mode.DUALBLADE else KVPath.PAGECACHE,
                         drop_after_use=plan.mode is Mode.CACHEPOLICY)
            demoted.append(nk)
            kpus.append(nk)
        else:
            kpus.append(k)
    n1 = whole_layers(keep, plan.geometry.layers)
    padding = sum(k.padded_bytes - k.nbytes for k in kpus if k.path is KVPath.DIRECT)
    new = replace(plan, group1_limit_bytes=target.group1_limit_bytes, group1_layers=n1, kpus=tuple(kpus),
                  padding_bytes=padding, budget_bytes=budget_bytes, ranker=rk.name)
    return Replan(old=plan, new=new, demoted=tuple(demoted))


class BudgetLedger:
    """Shares one ``B_pc`` among live sessions.

    A new session is granted what the live ones do not hold
    (:meth:`available`); when ``B_pc`` shrinks below what is held,
    :meth:`shrink` says how much each session may keep, taking from the
    newest sessions first (the older ones have the warmest caches and the
    fewest steps left to amortise a move).  Sessions whose plans cannot shrink
    (``baseline``, ``direct``) are left alone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: OrderedDict[Hashable, Plan] = OrderedDict()
        self._fixed: set[Hashable] = set()      # held, but never asked to shrink (a block pool's page cache)

    def available(self, pagecache_budget_bytes: int) -> int:
        """What of ``B_pc`` the live sessions' Group 1 leaves for a new session."""
        with self._lock:
            return max(0, pagecache_budget_bytes - sum(p.group1_bytes for p in self._held.values()))

    def admit(self, session: Hashable, plan: Plan, *, fixed: bool = False) -> None:
        """Record (or update) the page-cache bytes a session's plan holds; ``fixed``: a holder that cannot
        demote (:meth:`shrink` takes from the others instead)."""
        with self._lock:
            self._held[session] = plan
            if fixed:
                self._fixed.add(session)

    def release(self, session: Hashable) -> None:
        with self._lock:
            self._held.pop(session, None)
            self._fixed.discard(session)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(p.group1_bytes for p in self._held.values())

    def shrink(self, pagecache_budget_bytes: int) -> dict[Hashable, int]:
        """New grants for the sessions that must give bytes back so that the total fits ``B_pc``."""
        with self._lock:
            excess = sum(p.group1_bytes for p in self._held.values()) - max(0, pagecache_budget_bytes)
            out: dict[Hashable, int] = {}
            for session, plan in reversed(self._held.items()):
                if excess <= 0:
                    break
                if plan.mode not in (Mode.CACHEPOLICY, Mode.DUALBLADE) or plan.group1_bytes == 0 or \
                        session in self._fixed:
                    continue
                give = min(excess, plan.group1_bytes)
                out[session] = plan.group1_bytes - give
                excess -= give
            return out

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"sessions": {str(s): p.group1_bytes for s, p in self._held.items()},
                    "held_bytes": sum(p.group1_bytes for p in self._held.values())}
