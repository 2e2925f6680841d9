"""The storage wing: where KPUs live and how their bytes move -- one store interface (``base``), one module
per store (the extent store's packed-row edges and tails in ``edges``), the channel a request runs on
(``channel``), the lane's per-KPU gates (``gates``), row checksums (``integrity``), the crash-recovery journal
(``journal``) and the one way back for a written run of the region (``release``).

==========================  ==================================================
:class:`PageCacheKPUStore`  the page-cache path: one file per KPU
                            (``bladed.server.storage.pagecache_store``)
:class:`ExtentKPUStore`     the NVMe-direct path: the session's contiguous LBA
                            extent, token rows packed back to back
                            (``bladed.server.storage.extent_store``)
==========================  ==================================================

A session has one of each; every KPU is in exactly one of them (its plan's
``path``), and a live demotion moves one from the page-cache store to the
extent store (:meth:`ExtentKPUStore.adopt`).  The channel hands each store the
:class:`Access` es of one request that fall to it; the store runs them
together (the extent store submits them to the channel's ring at once, so the
device sees the whole batch) and fills in each one's :class:`RangeResult`: a
failure of one range never fails another.
"""

from bladed.server.storage.base import Access, ChannelIO, KPUStore
from bladed.server.storage.extent_store import ExtentKPUStore
from bladed.server.storage.pagecache_store import PageCacheKPUStore

__all__ = ["Access", "ChannelIO", "ExtentKPUStore", "KPUStore", "PageCacheKPUStore"]
