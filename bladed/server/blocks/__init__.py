"""Block pools: a store of fixed-size KV blocks keyed by opaque hashes, for serving engines (vLLM).

A serving engine's prefix cache names each block of KV by a chained hash
(vLLM's block hash and KV group: ``OffloadKey``).  A *pool* holds such blocks
for one scope (the peer's uid or group, as retained prefixes) and one model
shape: ``pages`` pages of ``page_bytes`` per block (one per attention layer),
``capacity`` blocks in all.  Its storage is laid out like a session's: a
geometry whose KPU ``p`` holds page ``p`` of every block, one "token" row per
block slot, placed by Algorithm 1 with a grant of the page-cache budget
(``blocks.pagecache_bytes`` and what live sessions leave; the rest on one
extent).  Block ``s`` of a pool is row ``s`` of every KPU.

An engine's scheduler reserves slots for the blocks it is about to store
(least recently used blocks not being read are evicted for them, or the store
is refused: never a wait), its workers write the pages through an attachment
(a session over the pool's storage: the ordinary data connections, batched
ranges, a crc32c per row) and commit them; a lookup finds committed blocks,
a load pins them, reads them and checks with the daemon that they are still
the blocks pinned (a generation per commit).  Slots a pool drops without
reuse are TRIMmed (direct KPUs) and punched (page-cache files).

The journal lists each pool (a retained record whose id starts with ``b``);
its slot index, with each committed slot's key, generation and crcs, is
``state/blocks/ID.idx``.  At start-up the pool and its committed blocks come
back; their crcs are checked on every load, so a block torn by a crash is a
miss, never KV.
"""
