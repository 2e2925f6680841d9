"""Retained prefixes: the KV of a session kept after it, found again by a chain of token-block hashes.

A session may be opened with a *prefix key* (``prefix`` in ``open_session``:
the model's name, its dtype and the prompt's token ids).  The daemon cuts the
tokens into blocks of ``prefix.block_tokens`` and hashes them as a chain: the
hash of block ``i`` covers the key's *seed* (model, dtype, geometry) and every
token before the end of block ``i``, so equal hashes mean an equal prefix of
the same model.  It looks the chain up among the retained prefixes of the
peer's *scope* (its uid, or its primary group with ``prefix.scope = "group"``)
and copies the KV of the longest match into the new session before the reply,
which says how many leading tokens are already there.  The client skips their
prefill.

``retain`` (on a live session) copies the KV of its first whole blocks into
a new *entry*: storage of its own, laid out by the same planner as a session
(Algorithm 1: what fits ``prefix.pagecache_bytes`` and the free page-cache
budget in page-cache files, the rest on an extent), with a crc32c per KPU and
block.  Sessions never write an entry: a hit is copied (the whole matched
blocks), so two sessions can start from one entry at once and neither can
change it.  Entries are evicted least recently used first: beyond the quotas
(``prefix.device_bytes``, ``prefix.pagecache_bytes``), when a live session
needs the page-cache budget or the region's blocks, and by ``evict_prefixes``;
their blocks are scrubbed like a session's.

The journal lists every entry (``bladed.server.storage.journal.RetainedRecord``) before
anything is copied, as ``writing``, and as ``ready`` once its KV and checksums
are on storage.  At start-up a ``writing`` entry is reclaimed; a ``ready`` one
is read back whole and kept only if every checksum verifies.
"""
