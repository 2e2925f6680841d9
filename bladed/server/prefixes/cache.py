"""The retained prefixes of one daemon: lookup and copy into a new session, retain (plan, bind, copy in,
journal), room for live sessions, restore at start-up.  The wing's story is in ``prefixes/__init__``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bladed.config import Config
from bladed.io import BladedIOError, ExtentDevice
from bladed.protocol import ErrorCode, RequestError
from bladed.residency.extents import Extent, ExtentAllocator, RegionFullError
from bladed.residency.geometry import Geometry
from bladed.residency.planner import Mode, plan_session
from bladed.server.events import Peer, event
from bladed.server.metrics import Stats
from bladed.server.prefixes.copy import copy_channel, copy_in, copy_out, write_blocks
from bladed.server.prefixes.entry import (
    Lookup,
    RetainedPrefix,
    SessionKV,
    crc_path,
    fsync_file,
)
from bladed.server.prefixes.index import PrefixIndex
from bladed.server.prefixes.keys import block_chain, parse_key, seed_of
from bladed.server.prefixes.restore import rebuild, verify
from bladed.server.prefixes.shared_tier import SharedTier, chain_refs
from bladed.server.storage import ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.channel import Channel
from bladed.server.storage.journal import READY, WRITING, Journal, RetainedRecord
from bladed.server.storage.pagecache_store import RETAINED_DIR_PREFIX
from bladed.server.storage.release import scrub_and_free
from bladed.server.wear import WearLedger

log = logging.getLogger("bladed.prefix")


class PrefixCache:
    """The retained prefixes of one daemon: lookup, retain, eviction, persistence."""

    def __init__(self, cfg: Config, device: ExtentDevice, allocator: ExtentAllocator, journal: Journal,
                 stats: Stats, wear: WearLedger | None = None) -> None:
        self.cfg = cfg
        #: the daemon's wear ledger: a retained prefix on the device is a new direct-path spill (io.write_budget)
        self.wear = wear
        self.device = device
        self.allocator = allocator
        self.journal = journal
        self.stats = stats
        self.index = PrefixIndex(stats, self._drop)
        #: page-cache bytes live sessions leave free (set by the session manager: ledger.available(B_pc) less what
        #: the entries hold)
        self.pagecache_room: Callable[[], int] = lambda: 0
        #: the shared tier (``prefix.shared_url``; bladed.server.prefixes.shared_tier), None when off
        self.shared = SharedTier(cfg.prefix, stats) if cfg.prefix.shared_url else None
        os.makedirs(os.path.join(cfg.state_dir, "prefixes"), mode=0o700, exist_ok=True)

    # -- figures ----------------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.cfg.prefix.block_tokens

    def scope_of(self, peer: Peer) -> str:
        return f"gid:{peer.gid}" if self.cfg.prefix.scope == "group" else f"uid:{peer.uid}"

    def visible(self, entry: RetainedPrefix, peer: Peer, admin: bool) -> bool:
        return admin or entry.rec.scope == self.scope_of(peer)

    @property
    def pagecache_bytes(self) -> int:
        return self.index.pagecache_bytes

    def cached_bytes(self) -> int:
        """Bytes of the retained prefixes' page-cache files now in the page cache."""
        return self.index.cached_bytes()

    @property
    def device_bytes(self) -> int:
        return self.index.device_bytes

    def gauges(self) -> dict[str, int]:
        return self.index.gauges()

    def describe(self, peer: Peer, admin: bool) -> list[dict[str, Any]]:
        return [e.describe() for e in self.index.matching(lambda e: self.visible(e, peer, admin))]

    def _copy_channel(self, geometry: Geometry) -> Channel:
        return copy_channel(self.device, self.cfg.io.queue_depth, self.cfg.io.read_window_bytes, geometry)

    def _close_channel(self, ch: Channel, into: SessionKV | None = None) -> None:
        """Close a private copy channel; what it wrote counts, for the session it copied into too."""
        written = dict(ch.engine.written)
        ch.close()
        self.stats.count_written(written)
        if into is not None:
            into.count_written(written)

    # -- lookup and copy into a new session ---------------------------------------------------
    def lookup(self, geometry: Geometry, peer: Peer, raw: Any) -> Lookup:
        """Find the longest retained prefix of ``raw`` (``open_session``'s ``prefix``) for a session about to be
        planned; a hit is held against eviction until :meth:`fill` or :meth:`cancel`."""
        model, dtype, tokens = parse_key(raw, geometry, where="prefix")
        seed = seed_of(model, dtype, geometry)
        chain = block_chain(seed, tokens, self.block_tokens)
        scope = self.scope_of(peer)
        entry, blocks = self.index.acquire(scope, seed.hex(), self.block_tokens, chain)
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
            self.index.release(found.entry)
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
        ch = self._copy_channel(sess.geometry)
        try:
            n = write_blocks(sess, found.remote, self.block_tokens, ch)
        finally:
            self._close_channel(ch, sess)
        self.stats.add("prefix_hits")
        self.stats.add("prefix_shared_hits")
        self.stats.add("prefix_reused_tokens", n)
        event("prefix_hit", session=sess.id, entry="shared", tokens=n, of=found.ntokens, source="shared")
        return {"tokens": n, "source": "shared"}

    def _copy_out(self, entry: RetainedPrefix, sess: SessionKV, blocks: int) -> bool:
        """Copy ``blocks`` whole blocks of every KPU from ``entry`` into ``sess``, each verified against its crcs
        first; False (and the entry evicted) if one does not verify or cannot be read."""
        ch = self._copy_channel(sess.geometry)
        try:
            with entry.copy_lock:
                bad = copy_out(entry, sess, blocks, ch)
        finally:
            self._close_channel(ch, sess)
        if bad is not None:
            if bad == "integrity_error":
                self.stats.add("integrity_errors")
            self.index.condemn(entry, bad)
        return bad is None

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
        for e in self.index.matching(lambda e: e.matches(scope, seed_hex, B) and e.rec.hashes[:len(chain)] == chain):
            e.last_used = time.time()
            return {"entry": e.id, "tokens": e.tokens, "new": False}
        # the entries of this scope whose chain the new one extends are superseded: they go first, so their room
        # is the new entry's (a chat's turn n replaces turn n - 1)
        for e in self.index.matching(lambda e: e.matches(scope, seed_hex, B) and e.users == 0
                                     and chain[:len(e.rec.hashes)] == e.rec.hashes):
            self.index.evict(e, "superseded")
        geometry = dataclasses.replace(sess.geometry, max_tokens=len(chain) * B)
        entry = self._make(scope, model, dtype, seed_hex, geometry, chain, sess.id)
        blocks_out = [bytearray(2 * geometry.layers * B * geometry.token_bytes) for _ in chain] if self.shared else None
        try:
            self._copy_in(entry, sess, blocks_out)
        except BaseException:
            self._drop(entry, "failed")
            raise
        self.index.add(entry)
        self.stats.add("prefix_retained")
        if self.shared is not None and blocks_out is not None:
            self.shared.publish(list(zip(chain_refs(scope, seed, B, chain), map(bytes, blocks_out), strict=True)))
        event("prefix_retain", session=sess.id, entry=entry.id, tokens=entry.tokens, scope=scope,
              pagecache_bytes=entry.pagecache_bytes, device_bytes=entry.device_bytes)
        return {"entry": entry.id, "tokens": entry.tokens, "new": True}

    def _make(self, scope: str, model: str, dtype: str, seed_hex: str, geometry: Geometry, chain: list[str],
              sid: str) -> RetainedPrefix:
        """Plan and bind a new entry's storage, making room by eviction; journaled as ``writing``."""
        pr = self.cfg.prefix
        lba = self.device.lba_size

        def grant() -> int:
            # Algorithm 1's knob for the entry: what the quota and the live sessions' budget leave
            return max(0, min(pr.pagecache_bytes - self.pagecache_bytes, self.pagecache_room()))

        # io.write_budget spent: an entry that needs the device even with every other entry's page cache is
        # refused before any entry is evicted for it
        best = max(0, min(pr.pagecache_bytes, self.pagecache_room() + self.pagecache_bytes))
        self._check_spill(plan_session(geometry, Mode.DUALBLADE, best, lba).extent_blocks * lba)

        # the newest prefix is the hottest: older ones leave the page cache for it (least recently used first)
        while grant() < geometry.kv_bytes and self.index.evict_lru("pagecache_quota", lambda e: e.pagecache_bytes > 0):
            pass
        g = grant()
        plan = plan_session(geometry, Mode.DUALBLADE, g, lba)
        need = plan.extent_blocks * lba
        self._check_spill(need)
        if need > pr.device_bytes:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED,
                               f"retaining {geometry.max_tokens} tokens needs {need} device bytes, more than "
                               f"prefix.device_bytes ({pr.device_bytes}) allows; raise it or retain fewer tokens")
        self.index.evict_until(lambda: self.device_bytes + need <= pr.device_bytes, "device_quota")
        if self.device_bytes + need > pr.device_bytes:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED, "the retained prefixes being copied into sessions fill "
                                                         "prefix.device_bytes; retry when those copies are done")
        eid = f"p{secrets.token_hex(6)}"
        extent = self._allocate(plan.extent_blocks, eid) if plan.extent_blocks else None
        pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, eid, plan.pagecache_kpus(),
                                      dir_prefix=RETAINED_DIR_PREFIX)
        rec = RetainedRecord(id=eid, scope=scope, model=model, dtype=dtype, seed=seed_hex,
                             geometry=geometry.fields(), block_tokens=self.block_tokens, hashes=chain, grant=g,
                             extents=[(extent.start, extent.nblocks)] if extent else [],
                             pagecache_dir=pagecache.directory)
        entry = RetainedPrefix(rec, plan, pagecache, ExtentKPUStore(plan, extent, 1),
                      np.zeros((2 * geometry.layers, len(chain)), dtype=np.uint32))
        # journaled before anything is written: a crash from here on reclaims it
        self.journal.add_retained(rec)
        pagecache.create()
        entry.extent_store.prepare()
        log.debug("retaining %d tokens of session %s as %s", geometry.max_tokens, sid, eid)
        return entry

    def _check_spill(self, device_bytes: int) -> None:
        """Refuse a retain that writes ``device_bytes`` to the device once io.write_budget is spent today."""
        if device_bytes and self.wear is not None:
            self.wear.check_spill("prefix", f"retaining a prefix with {device_bytes} bytes on the device",
                                  self.cfg.io.write_budget)

    def _allocate(self, blocks: int, owner: str) -> Extent:
        while True:
            try:
                return self.allocator.allocate(blocks, owner=owner)
            except RegionFullError as e:
                if not self.index.evict_lru("region_full", lambda en: en.device_bytes > 0):
                    raise RequestError(ErrorCode.NO_SPACE, f"no room to retain the prefix: {e}") from None

    def _copy_in(self, entry: RetainedPrefix, sess: SessionKV, blocks_out: list[bytearray] | None = None) -> None:
        """Copy the session's first ``entry.tokens`` tokens of every KPU into the entry with their crcs, then
        make it durable and journal it ``ready``."""
        ch = self._copy_channel(sess.geometry)
        try:
            copy_in(entry, sess, ch, blocks_out)
        finally:
            self._close_channel(ch)
        # on storage before the journal calls it ready: a crash after this point keeps a whole entry
        entry.pagecache.sync()
        np.ascontiguousarray(entry.crcs).tofile(crc_path(self.cfg.state_dir, entry.id))
        fsync_file(crc_path(self.cfg.state_dir, entry.id))
        entry.rec.state = READY
        self.journal.add_retained(entry.rec)

    # -- eviction -----------------------------------------------------------------------------
    def make_room_pagecache(self, keep_bytes: int) -> None:
        """Evict entries from the page cache until they hold at most ``keep_bytes`` (a live session comes first)."""
        self.index.evict_until(lambda: self.pagecache_bytes <= max(0, keep_bytes), "live_session")
        if self.pagecache_bytes > max(0, keep_bytes):
            log.info("retained prefixes in use hold %d page-cache bytes a new session could use",
                     self.pagecache_bytes)

    def make_room_device(self) -> bool:
        """Evict the least recently used entry holding device blocks (a live session needs them)."""
        return self.index.evict_lru("live_session", lambda e: e.device_bytes > 0)

    def evict_matching(self, peer: Peer, admin: bool, entry_id: str | None) -> list[str]:
        """``evict_prefixes``: one entry by id, or all the peer may see; the ids evicted."""
        return self.index.evict_matching(lambda e: self.visible(e, peer, admin), entry_id)

    def _drop(self, entry: RetainedPrefix, reason: str) -> None:
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
            os.unlink(crc_path(self.cfg.state_dir, rec.id))
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
        folder = os.path.dirname(crc_path(self.cfg.state_dir, "x"))
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
            self.index.add(entry)
            kept += 1
        if records:
            event("prefix_restore", kept=kept, dropped=len(records) - kept)

    def _unverified(self, rec: RetainedRecord, why: Exception, extents: list[Extent]) -> None:
        log.warning("retained prefix %s is not served after the restart: %s", rec.id, why)
        self.stats.count("prefix_evictions", "unverified")
        self._forget(rec, extents)

    def _rebuild(self, rec: RetainedRecord) -> RetainedPrefix:
        return rebuild(rec, self.cfg.pagecache_dir, crc_path(self.cfg.state_dir, rec.id), self.device.lba_size,
                       self.allocator)

    def _verify(self, entry: RetainedPrefix) -> None:
        geometry = Geometry.from_dict(entry.rec.geometry)
        ch = self._copy_channel(geometry)
        try:
            verify(entry, ch)
        finally:
            self._close_channel(ch)

    def close(self) -> None:
        """A clean stop: unmap every entry, keeping its storage and journal record for the next start."""
        for e in self.index.take_all():
            e.extent_store.close()
            e.pagecache.close(remove=False)
        if self.shared is not None:
            self.shared.close()


__all__ = ["PrefixCache"]
