"""Where a session's KPUs live: one interface, one module per store.

==========================  ==================================================
:class:`PageCacheKPUStore`  the page-cache path: one mmap'd file per KPU
                            (``bladed.server.stores.pagecache``)
:class:`ExtentKPUStore`     the NVMe-direct path: the session's contiguous LBA
                            extent, token rows packed back to back
                            (``bladed.server.stores.extent``)
==========================  ==================================================

A session has one of each; every KPU is in exactly one of them (its plan's
``path``), and a live demotion moves one from the page-cache store to the
extent store (:meth:`ExtentKPUStore.adopt`).  The channel hands each store the
:class:`Access` es of one request that fall to it; the store runs them
together (the extent store submits them to the channel's ring at once, so the
device sees the whole batch) and fills in each one's :class:`RangeResult`: a
failure of one range never fails another.
"""

from bladed.server.stores.base import Access, ChannelIO, KPUStore
from bladed.server.stores.extent import ExtentKPUStore
from bladed.server.stores.pagecache import PageCacheKPUStore

__all__ = ["Access", "ChannelIO", "ExtentKPUStore", "KPUStore", "PageCacheKPUStore"]
