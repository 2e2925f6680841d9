"""The residency floor: the page-cache budget (Eq. 1-2), the KPU planner
(Algorithm 1; the four configurations of the paper's Table III) and the LBA extents (Eq. 3-6, Algorithm 2).

Knows model geometry and bytes; does no I/O on KV data and knows nothing of
sessions' sockets or devices.
"""

from __future__ import annotations

from bladed.residency.budget import BudgetBreakdown, Budgeter
from bladed.residency.cgroups import CgroupInfo, locate_memory_cgroup
from bladed.residency.extents import (
    Extent,
    ExtentAllocator,
    ExtentMap,
    IndexOutOfRangeError,
    MisalignedRequestError,
    RegionFullError,
    TranslationError,
)
from bladed.residency.geometry import MODEL_SHAPES, Geometry
from bladed.residency.planner import (
    KPU,
    RANKERS,
    BudgetLedger,
    KpuFillRanker,
    KVPath,
    LayerOrderRanker,
    Mode,
    Plan,
    Ranker,
    Replan,
    get_ranker,
    plan_session,
    replan,
)

__all__ = [
    "KPU",
    "MODEL_SHAPES",
    "RANKERS",
    "BudgetBreakdown",
    "BudgetLedger",
    "Budgeter",
    "CgroupInfo",
    "Extent",
    "ExtentAllocator",
    "ExtentMap",
    "Geometry",
    "IndexOutOfRangeError",
    "KVPath",
    "KpuFillRanker",
    "LayerOrderRanker",
    "MisalignedRequestError",
    "Mode",
    "Plan",
    "Ranker",
    "RegionFullError",
    "Replan",
    "TranslationError",
    "get_ranker",
    "locate_memory_cgroup",
    "plan_session",
    "replan",
]
