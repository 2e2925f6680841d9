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

The journal lists every entry (``bladed.server.state.RetainedRecord``) before
anything is copied, as ``writing``, and as ``ready`` once its KV and checksums
are on storage.  At start-up a ``writing`` entry is reclaimed; a ``ready`` one
is read back whole and kept only if every checksum verifies.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from bladed.config import Config
from bladed.io import BladedIOError, Engine, ExtentDevice, StagingBuffer
from bladed.protocol import ErrorCode, IOOp, IORange, RangeResult, RequestError, get_field
from bladed.residency.extents import Extent, ExtentAllocator, RegionFullError
from bladed.residency.geometry import DTYPE_BYTES, GEOMETRY_FIELDS, Geometry
from bladed.residency.planner import KPU, Mode, Plan, plan_session
from bladed.server.channel import Channel
from bladed.server.events import Peer, event
from bladed.server.integrity import row_crcs
from bladed.server.lifecycle import scrub_and_free
from bladed.server.metrics import Stats
from bladed.server.shared_tier import SharedTier, chain_refs
from bladed.server.state import READY, WRITING, Journal, RetainedRecord
from bladed.server.stores import Access, ExtentKPUStore, PageCacheKPUStore
from bladed.server.stores.pagecache import RETAINED_DIR_PREFIX
from bladed.sizes import PAGE_SIZE, align_up


class SessionKV(Protocol):
    """What the prefix cache uses of a session (``bladed.server.session.Session``, which imports this module)."""

    id: str
    geometry: Geometry
    prefix_key: tuple[str, str] | None

    def transfer(self, ch: Channel, ranges: Sequence[IORange]) -> list[RangeResult]: ...

    def filled_tokens(self) -> int: ...

log = logging.getLogger("bladed.prefix")

#: longest model name a prefix key may carry
MAX_MODEL_CHARS = 256
#: a token id is hashed as 4 little-endian bytes
TOKEN_LIMIT = 1 << 32
#: the hex digits kept of each block hash (128 bits)
HASH_HEX = 32


# -- the key --------------------------------------------------------------------------------------------
def seed_of(model: str, dtype: str, geometry: Geometry) -> bytes:
    """What every block hash of a prefix starts from: the model, its dtype and the KV shape (not its length)."""
    shape = ",".join(str(getattr(geometry, f)) for f in GEOMETRY_FIELDS if f != "max_tokens")
    return hashlib.sha256(f"bladed-prefix-1\0{model}\0{dtype}\0{shape}".encode()).digest()


def block_chain(seed: bytes, tokens: Sequence[int], block_tokens: int) -> list[str]:
    """The hash of each whole block of ``tokens``; block ``i``'s hash covers the seed and all tokens up to its end."""
    ids = np.asarray(tokens, dtype="<u4")
    out = []
    h = seed
    for b in range(len(ids) // block_tokens):
        h = hashlib.sha256(h + ids[b * block_tokens:(b + 1) * block_tokens].tobytes()).digest()
        out.append(h.hex()[:HASH_HEX])
    return out


def _tokens(raw: Any, name: str, limit: int) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{name}' must be a list of token ids (integers)")
    if len(raw) > limit:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{name}' has {len(raw)} tokens, more than the session's "
                                                  f"max_tokens ({limit})")
    if raw and not 0 <= min(raw) <= max(raw) < TOKEN_LIMIT:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{name}': token ids must be within 0..{TOKEN_LIMIT - 1}")
    return list(raw)


def parse_key(raw: Any, geometry: Geometry, *, where: str) -> tuple[str, str, list[int]]:
    """``(model, dtype, tokens)`` of a prefix key field (``open_session``'s ``prefix``, ``retain``)."""
    if not isinstance(raw, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}' must be an object with model, dtype and tokens")
    model = get_field(raw, "model", str, prefix=f"{where}.")
    dtype = get_field(raw, "dtype", str, prefix=f"{where}.")
    if not 0 < len(model) <= MAX_MODEL_CHARS:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}.model' must be 1..{MAX_MODEL_CHARS} characters")
    size = DTYPE_BYTES.get(dtype.rsplit(".", 1)[-1].lower())
    if size is None:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}.dtype': unknown dtype {dtype!r}; known are "
                                                  f"{', '.join(DTYPE_BYTES)}")
    if size != geometry.dtype_bytes:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field '{where}.dtype': {dtype} has {size}-byte elements, the "
                                                  f"session's geometry has dtype_bytes {geometry.dtype_bytes}")
    if geometry.batch != 1:
        raise RequestError(ErrorCode.BAD_REQUEST, f"prefix reuse needs a geometry of batch 1 (one sequence), got "
                                                  f"batch {geometry.batch}; leave out '{where}'")
    return model, dtype, _tokens(raw.get("tokens"), f"{where}.tokens", geometry.max_tokens)


# -- an entry ------------------------------------------------------------------------------------------------
class Entry:
    """One retained prefix: its key, its own storage (page-cache files and/or an extent) and its checksums."""

    def __init__(self, rec: RetainedRecord, plan: Plan, pagecache: PageCacheKPUStore, extent_store: ExtentKPUStore,
                 crcs: np.ndarray) -> None:
        self.rec = rec
        self.plan = plan
        self.pagecache = pagecache
        self.extent_store = extent_store
        #: crc32c of each (tensor, block): ``crcs[tid, b]`` covers the block's token rows of that KPU
        self.crcs = crcs
        self.last_used = time.time()
        self.hits = 0
        self.users = 0            # copies out of it in progress: not evictable meanwhile
        self.bad = False          # found corrupt while in use: out of the index, dropped by its last user
        #: one copy out of the entry at a time: its extent store assembles edge LBAs in one scratch buffer
        self.copy_lock = threading.Lock()

    def matches(self, scope: str, seed_hex: str, block_tokens: int) -> bool:
        """Same scope, same key seed (model, dtype, KV shape), same block size."""
        r = self.rec
        return r.scope == scope and r.seed == seed_hex and r.block_tokens == block_tokens

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def tokens(self) -> int:
        return len(self.rec.hashes) * self.rec.block_tokens

    @property
    def pagecache_bytes(self) -> int:
        return sum(k.pagecache_bytes for k in self.plan.pagecache_kpus())

    @property
    def device_bytes(self) -> int:
        ext = self.extent_store.extent
        return 0 if ext is None else ext.nblocks * self.plan.lba_size

    def store_of(self, kpu: KPU) -> PageCacheKPUStore | ExtentKPUStore:
        return self.extent_store if self.extent_store.holds(kpu.tensor_id) else self.pagecache

    def describe(self) -> dict[str, Any]:
        r = self.rec
        return {"entry": r.id, "scope": r.scope, "model": r.model, "dtype": r.dtype, "tokens": self.tokens,
                "block_tokens": r.block_tokens, "layers": r.geometry["layers"],
                "pagecache_bytes": self.pagecache_bytes, "device_bytes": self.device_bytes,
                "hits": self.hits, "created": r.created, "last_used": self.last_used, "in_use": self.users}


@dataclass
class Lookup:
    """What :meth:`PrefixCache.lookup` found for a prefix key: the entry (held) and how many blocks match."""

    model: str
    dtype: str
    ntokens: int
    entry: Entry | None
    blocks: int
    #: the verified blocks the shared tier gave (used instead of ``entry`` when it reaches further)
    remote: list[bytes] = field(default_factory=list)


def _crc_path(state_dir: str, entry_id: str) -> str:
    return os.path.join(state_dir, "prefixes", f"{entry_id}.crc")


# -- the cache -------------------------------------------------------------------------------------------
class PrefixCache:
    """The retained prefixes of one daemon: lookup, retain, eviction, persistence."""

    def __init__(self, cfg: Config, device: ExtentDevice, allocator: ExtentAllocator, journal: Journal,
                 stats: Stats) -> None:
        self.cfg = cfg
        self.device = device
        self.allocator = allocator
        self.journal = journal
        self.stats = stats
        self.entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        #: page-cache bytes live sessions leave free (set by the session manager: ledger.available(B_pc) less what
        #: the entries hold)
        self.pagecache_room: Callable[[], int] = lambda: 0
        #: the shared tier (``prefix.shared_url``; bladed.server.shared_tier), None when off
        self.shared = SharedTier(cfg.prefix, stats) if cfg.prefix.shared_url else None
        os.makedirs(os.path.join(cfg.state_dir, "prefixes"), mode=0o700, exist_ok=True)

    # -- figures ----------------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.cfg.prefix.block_tokens

    def scope_of(self, peer: Peer) -> str:
        return f"gid:{peer.gid}" if self.cfg.prefix.scope == "group" else f"uid:{peer.uid}"

    def visible(self, entry: Entry, peer: Peer, admin: bool) -> bool:
        return admin or entry.rec.scope == self.scope_of(peer)

    @property
    def pagecache_bytes(self) -> int:
        with self._lock:
            return sum(e.pagecache_bytes for e in self.entries.values())

    @property
    def device_bytes(self) -> int:
        with self._lock:
            return sum(e.device_bytes for e in self.entries.values())

    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self.entries), "tokens": sum(e.tokens for e in self.entries.values()),
                    "pagecache_bytes": sum(e.pagecache_bytes for e in self.entries.values()),
                    "device_bytes": sum(e.device_bytes for e in self.entries.values())}

    def describe(self, peer: Peer, admin: bool) -> list[dict[str, Any]]:
        with self._lock:
            return [e.describe() for e in self.entries.values() if self.visible(e, peer, admin)]

    # -- the copy channel -------------------------------------------------------------------
    def _copy_channel(self, geometry: Geometry) -> Channel:
        """A private ring and staging slot of one KPU: copies never pass through a client's memory."""
        slot = StagingBuffer(align_up(geometry.kpu_bytes, max(PAGE_SIZE, self.device.lba_size)))
        try:
            return Channel(0, Engine(self.device, self.cfg.io.queue_depth, [slot]), slot, self.cfg.io.read_window_bytes)
        except BaseException:
            slot.close()
            raise

    # -- lookup and copy into a new session ---------------------------------------------------
    def lookup(self, geometry: Geometry, peer: Peer, raw: Any) -> Lookup:
        """Find the longest retained prefix of ``raw`` (``open_session``'s ``prefix``) for a session about to be
        planned; a hit is held against eviction until :meth:`fill` or :meth:`cancel`."""
        model, dtype, tokens = parse_key(raw, geometry, where="prefix")
        seed = seed_of(model, dtype, geometry)
        chain = block_chain(seed, tokens, self.block_tokens)
        scope = self.scope_of(peer)
        entry, blocks = self._acquire(scope, seed, chain)
        found = Lookup(model, dtype, len(tokens), entry, blocks)
        if self.shared is not None and blocks < len(chain):
            # a local miss (or a shorter hit) asks the shared tier; its blocks are used only if they reach further
            B = self.block_tokens
            block_bytes = 2 * geometry.layers * B * geometry.token_bytes
            remote = self.shared.fetch(chain_refs(scope, seed, B, chain), block_bytes)
            if len(remote) > blocks:
                self.cancel(found)
                found.remote, found.blocks = remote, len(remote)
        return found

    def cancel(self, found: Lookup) -> None:
        """The session was not opened after all: let go of the entry."""
        if found.entry is not None:
            self._release(found.entry)
            found.entry = None

    def fill(self, sess: SessionKV, found: Lookup) -> dict[str, Any]:
        """Copy the prefix :meth:`lookup` found into ``sess`` (bound, not yet serving); returns the reply's
        ``prefix`` object (``tokens`` 0 on a miss)."""
        B = self.block_tokens
        sess.prefix_key = (found.model, found.dtype)
        entry = found.entry
        reply: dict[str, Any] = {"tokens": 0, "block_tokens": B, "entry": None, "source": None}
        if found.remote:
            return reply | self._fill_remote(sess, found)
        if entry is None:
            self.stats.add("prefix_misses")
            return reply
        ntokens = found.blocks * B
        try:
            ok = self._copy_out(entry, sess, found.blocks)
        finally:
            self.cancel(found)
        if not ok:
            self.stats.add("prefix_misses")
            return reply
        entry.hits += 1
        self.stats.add("prefix_hits")
        self.stats.add("prefix_reused_tokens", ntokens)
        event("prefix_hit", session=sess.id, entry=entry.id, tokens=ntokens, of=found.ntokens, source="local")
        return reply | {"tokens": ntokens, "entry": entry.id, "source": "local"}

    def _fill_remote(self, sess: SessionKV, found: Lookup) -> dict[str, Any]:
        """Write the blocks the shared tier gave (each verified) into ``sess``, KPU by KPU."""
        B, tb, L = self.block_tokens, sess.geometry.token_bytes, sess.geometry.layers
        span = B * tb
        n = len(found.remote) * B
        ch = self._copy_channel(sess.geometry)
        try:
            slot = ch.slot.view()
            for tid in range(2 * L):
                for b, payload in enumerate(found.remote):
                    slot[b * span:(b + 1) * span] = payload[tid * span:(tid + 1) * span]
                (r,) = sess.transfer(ch, [IORange(IOOp.WRITE, tid, 0, n, 0)])
                if r.error is not None:
                    raise RequestError(r.error, f"copying the shared prefix into the session: {r.message}")
            del slot
        finally:
            ch.close()
        self.stats.add("prefix_hits")
        self.stats.add("prefix_shared_hits")
        self.stats.add("prefix_reused_tokens", n)
        event("prefix_hit", session=sess.id, entry="shared", tokens=n, of=found.ntokens, source="shared")
        return {"tokens": n, "source": "shared"}

    def _acquire(self, scope: str, seed: bytes, chain: list[str]) -> tuple[Entry | None, int]:
        """The entry of ``scope`` sharing the most leading blocks with ``chain`` (held against eviction)."""
        best: Entry | None = None
        best_n = 0
        seed_hex = seed.hex()
        with self._lock:
            for e in self.entries.values():
                if not e.matches(scope, seed_hex, self.block_tokens):
                    continue
                n = 0
                for a, b in zip(e.rec.hashes, chain, strict=False):
                    if a != b:
                        break
                    n += 1
                if n > best_n or (n == best_n and n and best is not None and e.last_used > best.last_used):
                    best, best_n = e, n
            if best is not None:
                best.users += 1
                best.last_used = time.time()
        return best, best_n

    def _copy_out(self, entry: Entry, sess: SessionKV, blocks: int) -> bool:
        """Copy ``blocks`` whole blocks of every KPU from ``entry`` into ``sess``, each verified against its crcs
        first; False (and the entry evicted) if one does not verify or cannot be read."""
        B = entry.rec.block_tokens
        n = blocks * B
        tb = sess.geometry.token_bytes
        ch = self._copy_channel(sess.geometry)
        try:
            with entry.copy_lock:
                for kpu in entry.plan.kpus:
                    tid = kpu.tensor_id
                    a = Access(IOOp.READ, kpu, 0, n, 0, n * tb, 0)
                    entry.store_of(kpu).run(ch, [a])
                    if a.result.error is not None:
                        log.warning("retained prefix %s: %s; evicting it", entry.id, a.result.message)
                        self._condemn(entry, "io_error")
                        return False
                    if not np.array_equal(_block_crcs(ch.slot, blocks, B * tb), entry.crcs[tid, :blocks]):
                        log.error("retained prefix %s: %s does not match its checksums; evicting it", entry.id,
                                  kpu.name)
                        self.stats.add("integrity_errors")
                        self._condemn(entry, "integrity_error")
                        return False
                    (r,) = sess.transfer(ch, [IORange(IOOp.WRITE, tid, 0, n, 0)])
                    if r.error is not None:
                        raise RequestError(r.error, f"copying the retained prefix into the session: {r.message}")
        finally:
            ch.close()
        return True

    # -- retain ------------------------------------------------------------------------------
    def retain(self, sess: SessionKV, peer: Peer, body: dict[str, Any]) -> dict[str, Any]:
        """Copy the KV of the session's first whole blocks into a new entry (``retain``)."""
        pr = self.cfg.prefix
        if not pr.device_bytes and not pr.pagecache_bytes:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED, "prefix retention is off (prefix.device_bytes and "
                                                         "prefix.pagecache_bytes are 0); raise one to retain")
        raw = body.get("prefix")
        if raw is None and sess.prefix_key is not None:
            raw = {"model": sess.prefix_key[0], "dtype": sess.prefix_key[1]}
            if "tokens" in body:
                raw["tokens"] = body["tokens"]
        elif isinstance(raw, dict) and "tokens" not in raw and "tokens" in body:
            raw = raw | {"tokens": body["tokens"]}
        if raw is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "retain needs 'prefix' (model, dtype, tokens): this session was "
                                                      "not opened with one")
        model, dtype, tokens = parse_key(raw, sess.geometry, where="prefix")
        B = self.block_tokens
        seed = seed_of(model, dtype, sess.geometry)
        chain = block_chain(seed, tokens, B)
        if not chain:
            raise RequestError(ErrorCode.BAD_REQUEST, f"retain needs at least one whole block of {B} tokens "
                                                      f"(prefix.block_tokens), got {len(tokens)} tokens")
        written = sess.filled_tokens()
        if written < len(chain) * B:
            raise RequestError(ErrorCode.BAD_REQUEST, f"retain of {len(chain) * B} tokens, but the session has "
                                                      f"written only the first {written} of every KPU")
        scope = self.scope_of(peer)
        seed_hex = seed.hex()
        with self._lock:
            for e in self.entries.values():
                if e.matches(scope, seed_hex, B) and e.rec.hashes[:len(chain)] == chain:
                    e.last_used = time.time()
                    return {"entry": e.id, "tokens": e.tokens, "new": False}
        # the entries of this scope whose chain the new one extends are superseded: they go first, so their room
        # is the new entry's (a chat's turn n replaces turn n - 1)
        with self._lock:
            older = [e for e in self.entries.values()
                     if e.matches(scope, seed_hex, B) and e.users == 0 and chain[:len(e.rec.hashes)] == e.rec.hashes]
        for e in older:
            self.evict(e, "superseded")
        geometry = Geometry(**{f: getattr(sess.geometry, f) for f in GEOMETRY_FIELDS if f != "max_tokens"},
                            max_tokens=len(chain) * B)
        entry = self._make(scope, model, dtype, seed_hex, geometry, chain, sess.id)
        blocks_out = [bytearray(2 * geometry.layers * B * geometry.token_bytes) for _ in chain] if self.shared else None
        try:
            self._copy_in(entry, sess, blocks_out)
        except BaseException:
            self._drop(entry, "failed")
            raise
        with self._lock:
            self.entries[entry.id] = entry
        self.stats.add("prefix_retained")
        if self.shared is not None and blocks_out is not None:
            self.shared.publish(list(zip(chain_refs(scope, seed, B, chain), map(bytes, blocks_out), strict=True)))
        event("prefix_retain", session=sess.id, entry=entry.id, tokens=entry.tokens, scope=scope,
              pagecache_bytes=entry.pagecache_bytes, device_bytes=entry.device_bytes)
        return {"entry": entry.id, "tokens": entry.tokens, "new": True}

    def _make(self, scope: str, model: str, dtype: str, seed_hex: str, geometry: Geometry, chain: list[str],
              sid: str) -> Entry:
        """Plan and bind a new entry's storage, making room by eviction; journaled as ``writing``."""
        pr = self.cfg.prefix
        lba = self.device.lba_size

        def grant() -> int:
            # Algorithm 1's knob for the entry: what the quota and the live sessions' budget leave
            return max(0, min(pr.pagecache_bytes - self.pagecache_bytes, self.pagecache_room()))

        # the newest prefix is the hottest: older ones leave the page cache for it (least recently used first)
        while grant() < geometry.kv_bytes and self.evict_lru("pagecache_quota", lambda e: e.pagecache_bytes > 0):
            pass
        g = grant()
        plan = plan_session(geometry, Mode.DUALBLADE, g, lba)
        need = plan.extent_blocks * lba
        if need > pr.device_bytes:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED,
                               f"retaining {geometry.max_tokens} tokens needs {need} device bytes, more than "
                               f"prefix.device_bytes ({pr.device_bytes}) allows; raise it or retain fewer tokens")
        self._evict_until(lambda: self.device_bytes + need <= pr.device_bytes, "device_quota")
        if self.device_bytes + need > pr.device_bytes:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED, "the retained prefixes being copied into sessions fill "
                                                         "prefix.device_bytes; retry when those copies are done")
        eid = f"p{secrets.token_hex(6)}"
        extent = self._allocate(plan.extent_blocks, eid) if plan.extent_blocks else None
        pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, eid, plan.pagecache_kpus(),
                                      dir_prefix=RETAINED_DIR_PREFIX)
        rec = RetainedRecord(id=eid, scope=scope, model=model, dtype=dtype, seed=seed_hex,
                             geometry=_fields(geometry), block_tokens=self.block_tokens, hashes=chain, grant=g,
                             extents=[(extent.start, extent.nblocks)] if extent else [],
                             pagecache_dir=pagecache.directory)
        entry = Entry(rec, plan, pagecache, ExtentKPUStore(plan, extent, 1),
                      np.zeros((2 * geometry.layers, len(chain)), dtype=np.uint32))
        # journaled before anything is written: a crash from here on reclaims it
        self.journal.add_retained(rec)
        pagecache.create()
        entry.extent_store.prepare()
        log.debug("retaining %d tokens of session %s as %s", geometry.max_tokens, sid, eid)
        return entry

    def _allocate(self, blocks: int, owner: str) -> Extent:
        while True:
            try:
                return self.allocator.allocate(blocks, owner=owner)
            except RegionFullError as e:
                if not self.evict_lru("region_full", lambda en: en.device_bytes > 0):
                    raise RequestError(ErrorCode.NO_SPACE, f"no room to retain the prefix: {e}") from None

    def _copy_in(self, entry: Entry, sess: SessionKV, blocks_out: list[bytearray] | None = None) -> None:
        """Copy the session's first ``entry.tokens`` tokens of every KPU into the entry, recording the crcs (and
        gathering each block's rows of every KPU into ``blocks_out`` for the shared tier)."""
        B = entry.rec.block_tokens
        n = entry.tokens
        tb = sess.geometry.token_bytes
        ch = self._copy_channel(sess.geometry)
        try:
            for kpu in entry.plan.kpus:
                tid = kpu.tensor_id
                (r,) = sess.transfer(ch, [IORange(IOOp.READ, tid, 0, n, 0)])
                if r.error is not None:
                    raise RequestError(r.error, f"reading the session's KV to retain it: {r.message}")
                entry.crcs[tid] = _block_crcs(ch.slot, n // B, B * tb)
                if blocks_out is not None:
                    span = B * tb
                    rows = ch.slot.view()
                    for b, buf in enumerate(blocks_out):
                        buf[tid * span:(tid + 1) * span] = rows[b * span:(b + 1) * span]
                    del rows
                a = Access(IOOp.WRITE, kpu, 0, n, 0, n * tb, 0)
                entry.store_of(kpu).run(ch, [a])
                if a.result.error is not None:
                    raise RequestError(a.result.error, f"writing the retained prefix: {a.result.message}")
        finally:
            ch.close()
        # on storage before the journal calls it ready: a crash after this point keeps a whole entry
        entry.pagecache.sync()
        np.ascontiguousarray(entry.crcs).tofile(_crc_path(self.cfg.state_dir, entry.id))
        _fsync_file(_crc_path(self.cfg.state_dir, entry.id))
        entry.rec.state = READY
        self.journal.add_retained(entry.rec)

    # -- eviction -----------------------------------------------------------------------------
    def evict_lru(self, reason: str, which: Callable[[Entry], bool] = lambda e: True) -> bool:
        """Evict the least recently used entry not in use that ``which`` accepts; False if there is none."""
        with self._lock:
            idle = [e for e in self.entries.values() if e.users == 0 and which(e)]
            if not idle:
                return False
            victim = min(idle, key=lambda e: e.last_used)
        self.evict(victim, reason)
        return True

    def _evict_until(self, done: Callable[[], bool], reason: str) -> None:
        while not done() and self.evict_lru(reason):
            pass

    def make_room_pagecache(self, keep_bytes: int) -> None:
        """Evict entries from the page cache until they hold at most ``keep_bytes`` (a live session comes first)."""
        self._evict_until(lambda: self.pagecache_bytes <= max(0, keep_bytes), "live_session")
        if self.pagecache_bytes > max(0, keep_bytes):
            log.info("retained prefixes in use hold %d page-cache bytes a new session could use",
                     self.pagecache_bytes)

    def make_room_device(self) -> bool:
        """Evict the least recently used entry holding device blocks (a live session needs them)."""
        return self.evict_lru("live_session", lambda e: e.device_bytes > 0)

    def evict(self, entry: Entry, reason: str) -> bool:
        """Remove an entry and scrub its storage; False if it is gone or in use."""
        with self._lock:
            if self.entries.get(entry.id) is not entry or entry.users:
                return False
            del self.entries[entry.id]
        self._drop(entry, reason)
        self.stats.count("prefix_evictions", reason)
        event("prefix_evict", entry=entry.id, reason=reason, tokens=entry.tokens, hits=entry.hits)
        return True

    def _condemn(self, entry: Entry, reason: str) -> None:
        """An entry found bad while a copy holds it: out of the index now, dropped by its last user."""
        with self._lock:
            if self.entries.get(entry.id) is entry:
                del self.entries[entry.id]
            entry.bad = True
        self.stats.count("prefix_evictions", reason)
        event("prefix_evict", entry=entry.id, reason=reason, tokens=entry.tokens, hits=entry.hits)

    def _release(self, entry: Entry) -> None:
        """A copy out of ``entry`` is done (a condemned entry is dropped by its last user)."""
        with self._lock:
            entry.users -= 1
            last = entry.bad and entry.users == 0
        if last:
            self._drop(entry, "condemned")

    def evict_matching(self, peer: Peer, admin: bool, entry_id: str | None) -> list[str]:
        """``evict_prefixes``: one entry by id, or all the peer may see; the ids evicted."""
        with self._lock:
            targets = [e for e in self.entries.values() if self.visible(e, peer, admin) and
                       (entry_id is None or e.id == entry_id)]
        if entry_id is not None and not targets:
            # the same answer whether it does not exist or is another scope's: no probing
            raise RequestError(ErrorCode.BAD_REQUEST, f"no retained prefix {entry_id!r} (see bladectl prefixes)")
        done = [e.id for e in targets if self.evict(e, "requested")]
        busy = [e.id for e in targets if e.id not in done]
        if entry_id is not None and busy:
            raise RequestError(ErrorCode.BUSY, f"retained prefix {entry_id} is being copied into a session; retry")
        return done

    def _drop(self, entry: Entry, reason: str) -> None:
        """Scrub and free an entry's storage and forget it in the journal."""
        ext = entry.extent_store.close()
        entry.pagecache.close()
        self._forget(entry.rec, [ext] if ext is not None else [])
        log.debug("retained prefix %s dropped (%s)", entry.id, reason)

    def _forget(self, rec: RetainedRecord, extents: list[Extent]) -> None:
        """Scrub and free ``extents``, remove the record's files, and its journal record once nothing is left."""
        quarantined = False
        for ext in extents:
            # one that cannot be scrubbed stays in the journal (and out of use): the next start-up tries again
            _, _, freed = scrub_and_free(self.device, self.allocator, self.stats, ext,
                                         owner=f"retained prefix {rec.id}",
                                         always_zero=self.cfg.device.zero_freed == "always")
            quarantined |= not freed
        if rec.pagecache_dir:
            shutil.rmtree(rec.pagecache_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_crc_path(self.cfg.state_dir, rec.id))
        if quarantined:
            rec.state = WRITING        # reclaimed (scrubbed) at the next start, never served
            self.journal.add_retained(rec)
        else:
            self.journal.remove_retained(rec.id)

    # -- start-up and stop ---------------------------------------------------------------------
    def restore(self, records: list[RetainedRecord]) -> None:
        """Rebuild the entries the journal kept (``lifecycle.reclaim``); keep those whose every crc verifies."""
        kept = 0
        # checksum files of entries the journal no longer keeps (reclaimed half-written ones) go first
        listed = {f"{r.id}.crc" for r in records}
        folder = os.path.dirname(_crc_path(self.cfg.state_dir, "x"))
        for name in os.listdir(folder):
            if name.endswith(".crc") and name not in listed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
        for rec in records:
            try:
                entry = self._rebuild(rec)
            except (OSError, ValueError, MemoryError) as e:
                self._unverified(rec, e, [x for x in self.allocator.extents if x.owner == rec.id])
                continue
            try:
                self._verify(entry)
            except (OSError, BladedIOError, ValueError, MemoryError) as e:
                ext = entry.extent_store.close()
                entry.pagecache.close()
                self._unverified(rec, e, [ext] if ext is not None else [])
                continue
            with self._lock:
                self.entries[rec.id] = entry
            kept += 1
        if records:
            event("prefix_restore", kept=kept, dropped=len(records) - kept)

    def _unverified(self, rec: RetainedRecord, why: Exception, extents: list[Extent]) -> None:
        log.warning("retained prefix %s is not served after the restart: %s", rec.id, why)
        self.stats.count("prefix_evictions", "unverified")
        self._forget(rec, extents)

    def _rebuild(self, rec: RetainedRecord) -> Entry:
        """The entry of a journal record, its layout made again by Algorithm 1 with the record's grant."""
        geometry = Geometry(**{f: int(rec.geometry[f]) for f in GEOMETRY_FIELDS})
        plan = plan_session(geometry, Mode.DUALBLADE, rec.grant, self.device.lba_size)
        blocks = len(rec.hashes)
        crcs = np.fromfile(_crc_path(self.cfg.state_dir, rec.id), dtype=np.uint32)
        if crcs.size != 2 * geometry.layers * blocks:
            raise ValueError(f"its checksum file has {crcs.size} entries, {2 * geometry.layers * blocks} expected")
        ext = None
        if rec.extents:
            s, n = rec.extents[0]
            ext = next((x for x in self.allocator.extents if x.owner == rec.id), None)
            if ext is None or n != plan.extent_blocks:
                raise ValueError(f"its extent {s}+{n} does not hold its layout")
        elif plan.extent_blocks:
            raise ValueError("its layout needs an extent and the journal lists none")
        pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, rec.id, plan.pagecache_kpus(),
                                      dir_prefix=RETAINED_DIR_PREFIX)
        if pagecache.directory != rec.pagecache_dir:
            raise ValueError(f"its page-cache directory {rec.pagecache_dir!r} is not where its layout puts it")
        pagecache.create(keep_existing=True)
        store = ExtentKPUStore(plan, ext, 1)
        store.prepare()
        store.assume_written(geometry.max_tokens * geometry.token_bytes)
        entry = Entry(rec, plan, pagecache, store, crcs.reshape(2 * geometry.layers, blocks))
        entry.last_used = rec.created
        return entry

    def _verify(self, entry: Entry) -> None:
        """Read every KPU of the entry back and compare each block's crc (ValueError naming the first bad one)."""
        geometry = Geometry(**{f: int(entry.rec.geometry[f]) for f in GEOMETRY_FIELDS})
        B, n, tb = entry.rec.block_tokens, entry.tokens, geometry.token_bytes
        for f in entry.pagecache.file_paths():  # a missing file would read back as zeroes
            if not os.path.exists(f):
                raise ValueError(f"its page-cache file {f} is missing")
        ch = self._copy_channel(geometry)
        try:
            for kpu in entry.plan.kpus:
                a = Access(IOOp.READ, kpu, 0, n, 0, n * tb, 0)
                entry.store_of(kpu).run(ch, [a])
                if a.result.error is not None:
                    raise ValueError(a.result.message)
                if not np.array_equal(_block_crcs(ch.slot, n // B, B * tb), entry.crcs[kpu.tensor_id]):
                    raise ValueError(f"{kpu.name} does not match its checksums")
        finally:
            ch.close()

    def close(self) -> None:
        """A clean stop: unmap every entry, keeping its storage and journal record for the next start."""
        with self._lock:
            entries, self.entries = list(self.entries.values()), {}
        for e in entries:
            e.extent_store.close()
            e.pagecache.close(remove=False)
        if self.shared is not None:
            self.shared.close()


def _fields(geometry: Geometry) -> dict[str, int]:
    return {f: getattr(geometry, f) for f in GEOMETRY_FIELDS}


def _block_crcs(slot: StagingBuffer, blocks: int, block_bytes: int) -> np.ndarray:
    """crc32c of each of ``blocks`` consecutive ``block_bytes`` blocks at the start of ``slot``."""
    return row_crcs(slot.view(), 0, blocks, block_bytes)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["Entry", "Lookup", "PrefixCache", "SessionKV", "block_chain", "parse_key", "seed_of"]
