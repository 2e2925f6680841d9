"""The daemon's block pools: creating one (plan, extent, journal), attachments (sessions over a pool's storage),
the ``blocks`` op's actions, a connection's end, restore at start-up and a clean stop."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
from typing import Any

from bladed.config import Config
from bladed.io import ExtentDevice
from bladed.protocol import ErrorCode, RequestError, get_field
from bladed.residency.extents import Extent, ExtentAllocator, RegionFullError
from bladed.residency.geometry import Geometry
from bladed.residency.planner import Mode, plan_session
from bladed.server.blocks.index import FREE, MAX_KEY_BYTES, PENDING, READY
from bladed.server.blocks.pool import MAX_POOL_CHANNELS, POOL_ID_PREFIX, BlockPool, pool_geometry, pool_seed
from bladed.server.events import Peer, event
from bladed.server.metrics import Stats
from bladed.server.sessions.manager import SessionManager
from bladed.server.sessions.session import ServedSession
from bladed.server.sessions.staging import passed_memfd, prepare_memfd
from bladed.server.storage import ExtentKPUStore, PageCacheKPUStore
from bladed.server.storage.journal import READY as RECORD_READY
from bladed.server.storage.journal import Journal, RetainedRecord
from bladed.server.storage.pagecache_store import RETAINED_DIR_PREFIX
from bladed.server.storage.release import scrub_and_free
from bladed.sizes import align_up

log = logging.getLogger("bladed.blocks")

#: the ``blocks`` op's actions (docs/protocol.md, "Block pools")
ACTIONS = ("open", "lookup", "reserve", "commit", "abort", "pin", "unpin", "verify", "touch", "evict", "pools",
           "drop_pool")
#: most keys or slots one ``blocks`` request may name (its reply must fit a frame)
MAX_ITEMS = 4096
_STATE = {READY: "ready", PENDING: "pending", FREE: "miss"}


class BlockStore:
    """Every block pool of the daemon and every attachment to one."""

    def __init__(self, cfg: Config, device: ExtentDevice, allocator: ExtentAllocator, journal: Journal,
                 stats: Stats, manager: SessionManager) -> None:
        self.cfg = cfg
        self.device = device
        self.allocator = allocator
        self.journal = journal
        self.stats = stats
        self.manager = manager
        self.pools: dict[str, BlockPool] = {}
        self.attachments: dict[str, tuple[ServedSession, BlockPool]] = {}
        self._lock = threading.Lock()
        self.folder = os.path.join(cfg.state_dir, "blocks")
        os.makedirs(self.folder, mode=0o700, exist_ok=True)

    def scope_of(self, peer: Peer) -> str:
        return f"gid:{peer.gid}" if self.cfg.prefix.scope == "group" else f"uid:{peer.uid}"

    def _index_path(self, pool_id: str) -> str:
        return os.path.join(self.folder, f"{pool_id}.idx")

    # -- pools --------------------------------------------------------------------------
    def pool(self, peer: Peer, raw: Any) -> BlockPool:
        """The pool of a ``blocks`` key (``open_blocks``), made on first use."""
        if not isinstance(raw, dict):
            raise RequestError(ErrorCode.BAD_REQUEST, "field 'blocks' must be an object with model, dtype, pages, "
                                                      "page_bytes, block_tokens and capacity_bytes")
        model = get_field(raw, "model", str, prefix="blocks.")
        dtype = get_field(raw, "dtype", str, prefix="blocks.")
        pages = get_field(raw, "pages", int, minimum=1, maximum=4096, prefix="blocks.")
        page_bytes = get_field(raw, "page_bytes", int, minimum=1, maximum=1 << 30, prefix="blocks.")
        block_tokens = get_field(raw, "block_tokens", int, minimum=1, maximum=1 << 20, prefix="blocks.")
        want = get_field(raw, "capacity_bytes", int, minimum=1, prefix="blocks.")
        if not 0 < len(model) <= 256 or not 0 < len(dtype) <= 64:
            raise RequestError(ErrorCode.BAD_REQUEST, "fields 'blocks.model' and 'blocks.dtype' must be 1..256 "
                                                      "and 1..64 characters")
        lba = self.device.lba_size
        if page_bytes % lba:
            raise RequestError(ErrorCode.BAD_REQUEST, f"field 'blocks.page_bytes': {page_bytes} is not a multiple of "
                                                      f"the store's {lba}-byte LBA; offload blocks of more tokens")
        scope = self.scope_of(peer)
        seed = pool_seed(model, dtype, pages, page_bytes, block_tokens)
        with self._lock:
            for p in self.pools.values():
                if p.rec.scope == scope and p.rec.seed == seed:
                    return p
            return self._make(scope, model, dtype, seed, pages, page_bytes, block_tokens, want)

    def _make(self, scope: str, model: str, dtype: str, seed: str, pages: int, page_bytes: int, block_tokens: int,
              want: int) -> BlockPool:
        bc = self.cfg.blocks
        if not bc.max_bytes:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED, "block pools are off (blocks.max_bytes is 0); raise it in "
                                                         "the daemon's configuration")
        block_bytes = 2 * ((pages + 1) // 2) * page_bytes
        capacity = min(want, bc.max_bytes) // block_bytes
        if capacity < 1:
            raise RequestError(ErrorCode.QUOTA_EXCEEDED,
                               f"a block of {block_bytes} bytes does not fit capacity_bytes {want} or blocks.max_bytes "
                               f"({bc.max_bytes}); raise them")
        geometry = pool_geometry(pages, page_bytes, capacity)
        lba = self.device.lba_size
        grant = max(0, min(bc.pagecache_bytes, self.manager.prefixes.pagecache_room()))
        plan = plan_session(geometry, Mode.DUALBLADE, grant, lba)
        if plan.extent_blocks and self.manager.wear is not None:
            self.manager.wear.check_spill("session", f"a block pool with {plan.direct_bytes} bytes on the direct path",
                                          self.cfg.io.write_budget)
        pid = f"{POOL_ID_PREFIX}{secrets.token_hex(6)}"
        extent = self._allocate(plan.extent_blocks, pid) if plan.extent_blocks else None
        pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, pid, plan.pagecache_kpus(),
                                      dir_prefix=RETAINED_DIR_PREFIX)
        rec = RetainedRecord(id=pid, scope=scope, model=model, dtype=dtype, seed=seed, geometry=geometry.fields(),
                             block_tokens=block_tokens, hashes=[], grant=grant,
                             extents=[(extent.start, extent.nblocks)] if extent else [],
                             pagecache_dir=pagecache.directory, state=RECORD_READY)
        try:
            pool = self._bind(rec, plan, pagecache, extent, fresh=True)
        except BaseException:
            # nothing was written yet: the extent goes back as it is, the files with their directory
            pagecache.close()
            if extent is not None:
                self.allocator.free(extent)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._index_path(pid))
            raise
        # journaled before any block is written: a crash from here on keeps (or reclaims) it
        self.journal.add_retained(rec)
        self.pools[pid] = pool
        self.manager.ledger.admit(pid, plan, fixed=True)
        event("blocks_pool_open", pool=pid, scope=scope, model=model, capacity=capacity, block_bytes=block_bytes,
              pagecache_bytes=pool.pagecache_bytes, device_bytes=pool.device_bytes)
        return pool

    def _bind(self, rec: RetainedRecord, plan: Any, pagecache: PageCacheKPUStore, extent: Extent | None, *,
              fresh: bool) -> BlockPool:
        pagecache.create(keep_existing=not fresh)
        store = ExtentKPUStore(plan, extent, MAX_POOL_CHANNELS)
        store.prepare()
        # every row may be read or written, in any order: the fill marks hold the whole KPU
        store.assume_written(plan.geometry.kpu_bytes)
        pool = BlockPool(rec, plan, pagecache, store, self._index_path(rec.id))
        pool.restore(pool.table.open(fresh=fresh))
        return pool

    def _allocate(self, blocks: int, owner: str) -> Extent:
        while True:
            try:
                return self.allocator.allocate(blocks, owner=owner)
            except RegionFullError as e:
                if not self.manager.prefixes.make_room_device():
                    raise RequestError(ErrorCode.NO_SPACE, f"no room for the block pool: {e}; lower "
                                                           "capacity_bytes or blocks.max_bytes") from None

    def _drop_pool(self, pool: BlockPool, reason: str) -> None:
        """Scrub and free a pool's storage, remove its files and its journal record."""
        self.pools.pop(pool.id, None)
        self.manager.ledger.release(pool.id)
        ext = pool.extent_store.close()
        pool.pagecache.close()
        pool.table.close(remove=True)
        freed = True
        if ext is not None:
            _, _, freed = scrub_and_free(self.device, self.allocator, self.stats, ext, owner=f"block pool {pool.id}",
                                         always_zero=self.cfg.device.zero_freed == "always")
        if pool.rec.pagecache_dir:
            shutil.rmtree(pool.rec.pagecache_dir, ignore_errors=True)
        if freed:
            self.journal.remove_retained(pool.id)
        event("blocks_pool_drop", pool=pool.id, reason=reason)

    # -- attachments ----------------------------------------------------------------------
    def attach(self, peer: Peer, body: dict[str, Any], fds: list[int]) -> tuple[ServedSession, dict[str, Any]]:
        """``open_blocks``: a session over a pool's storage with the client's staging; (session, reply)."""
        with passed_memfd("open_blocks", fds) as fd:
            return self._attach(peer, body, fd)

    def _attach(self, peer: Peer, body: dict[str, Any], fd: int) -> tuple[ServedSession, dict[str, Any]]:
        cfg = self.cfg
        pool = self.pool(peer, body.get("blocks"))
        g = pool.geometry
        channels = get_field(body, "channels", int, minimum=1, maximum=cfg.io.max_channels)
        slot_bytes = get_field(body, "slot_bytes", int, minimum=g.token_bytes, maximum=cfg.io.max_staging_bytes)
        stride = align_up(slot_bytes, self.manager.staging_align)
        staging_bytes = channels * stride
        if staging_bytes > cfg.io.max_staging_bytes:
            raise RequestError(ErrorCode.BAD_REQUEST, f"staging of {staging_bytes} bytes exceeds io.max_staging_bytes "
                                                      f"({cfg.io.max_staging_bytes}); use fewer channels or a smaller "
                                                      "slot")
        prepare_memfd(fd, staging_bytes)
        sid = f"{pool.id}.{secrets.token_hex(4)}"
        sess = ServedSession(sid, peer, g, pool.plan, {}, self.stats)
        sess.pagecache, sess.extent_store, sess.checksums = pool.pagecache, pool.extent_store, pool.checksums
        try:
            # the pool's stores are shared: with rows of whole LBAs (page_bytes, checked) and the page-aligned
            # offsets bladed.blocks sends, no range needs their per-channel edge or bounce buffers
            sess.map_staging(fd, staging_bytes, slot_bytes, stride, channels, self.device, cfg.io.queue_depth,
                             cfg.io.read_window_bytes, self.stats)
        except BaseException:
            self._release(sess)
            raise
        with self._lock:
            self.attachments[sid] = (sess, pool)
            pool.attachments.add(sid)
        return sess, sess.open_reply() | {"blocks": pool.describe()}

    def get(self, sid: str) -> ServedSession | None:
        with self._lock:
            a = self.attachments.get(sid)
        return None if a is None else a[0]

    def owns(self, sess: ServedSession) -> bool:
        with self._lock:
            return sess.id in self.attachments

    def close(self, sess: ServedSession) -> None:
        """Close an attachment: its data connections and channels, its staging; never the pool's storage."""
        with self._lock:
            a = self.attachments.pop(sess.id, None)
            if a is None:
                return
            _, pool = a
            pool.attachments.discard(sess.id)
        with sess._attach_lock:
            sess.closing = True
            attached = list(sess._attached)
        for conn in attached:
            conn.kill()
        for c in sess.channels:
            c.lock.acquire()     # the request in flight on it completes first
        try:
            self._release(sess)
        finally:
            for c in sess.channels:
                c.lock.release()

    def _release(self, sess: ServedSession) -> None:
        for c in sess.channels:
            self.stats.fold_lane(c)
            c.close()
        if sess.mapping is not None:
            try:
                sess.mapping.close()
            except BufferError:
                log.debug("attachment %s: staging mapping still exported", sess.id)
            sess.mapping = None

    def forget(self, owner: object) -> None:
        """A control connection ended: its pins go, its reserved slots never committed are freed (TRIMmed)."""
        for pool in list(self.pools.values()):
            freed = pool.table.forget_owner(owner)
            if freed:
                self.stats.add("trimmed_bytes", pool.trim(self.device, freed))

    # -- the blocks op --------------------------------------------------------------------
    def _find(self, peer: Peer, admin: bool, pool_id: str) -> BlockPool:
        pool = self.pools.get(pool_id)
        # another scope's pool is answered like one that does not exist
        if pool is None or not (admin or pool.rec.scope == self.scope_of(peer)):
            raise RequestError(ErrorCode.BAD_REQUEST, f"no block pool {pool_id!r} (open it with open_blocks)")
        return pool

    def op(self, peer: Peer, admin: bool, owner: object, body: dict[str, Any]) -> dict[str, Any]:
        """The ``blocks`` op: one action on one pool (docs/protocol.md, "Block pools")."""
        action = get_field(body, "action", str, choices=ACTIONS)
        if action == "open":
            return self.pool(peer, body.get("blocks")).describe()
        if action == "pools":
            scope = self.scope_of(peer)
            return {"pools": [p.describe() for p in list(self.pools.values()) if admin or p.rec.scope == scope]}
        pool = self._find(peer, admin, get_field(body, "pool", str))
        t = pool.table
        if action == "drop_pool":
            if pool.attachments:
                raise RequestError(ErrorCode.BUSY, f"block pool {pool.id} has {len(pool.attachments)} attachment(s) "
                                                   "open; close them first")
            with self._lock:
                self._drop_pool(pool, "requested")
            return {"dropped": pool.id}
        if action in ("lookup", "reserve", "pin", "touch") or (action == "evict" and body.get("keys") is not None):
            keys = _keys(body)
            if action == "lookup":
                return {"states": [_STATE[s] for s in t.lookup(keys)]}
            if action == "reserve":
                got, evicted, refused, evicted_slots = t.reserve(keys, owner)
                for s in evicted_slots:       # the new block's rows are not the old one's
                    for tid in range(2 * pool.geometry.layers):
                        pool.checksums.set_row(tid, s, None)
                if evicted:
                    self.stats.add("blocks_evicted", len(evicted))
                if refused:
                    self.stats.add("blocks_refused", refused)
                return {"store": [[r.key.hex(), r.slot, r.gen] for r in got], "evicted": [k.hex() for k in evicted],
                        "refused": refused}
            if action == "pin":
                return {"blocks": [None if x is None else list(x) for x in t.pin(keys, owner)]}
            if action == "touch":
                t.touch(keys)
                return {}
            gone, slots = t.drop(keys)
            self.stats.add("trimmed_bytes", pool.trim(self.device, slots))
            return {"evicted": [k.hex() for k in gone]}
        if action == "evict":
            gone, slots = t.drop(None)
            self.stats.add("trimmed_bytes", pool.trim(self.device, slots))
            return {"evicted": [k.hex() for k in gone]}
        items = _items(body)
        if action == "commit":
            # a slot whose every row was not written is never served: freed at once
            whole = [(s, g) for s, g in items if pool.written(s)]
            done = t.commit(whole, pool.crcs_of)
            ok = set(done)
            failed = [(s, g) for s, g in items if s not in ok]
            freed = t.abort(failed)
            self.stats.add("trimmed_bytes", pool.trim(self.device, freed))
            self.stats.add("blocks_stored", len(done))
            return {"committed": done}
        if action == "abort":
            freed = t.abort(items)
            self.stats.add("trimmed_bytes", pool.trim(self.device, freed))
            return {"aborted": freed}
        if action == "unpin":
            t.unpin(items, owner)
            return {}
        return {"valid": t.verify(items)}       # verify

    # -- start-up and stop ----------------------------------------------------------------
    def restore(self, records: list[RetainedRecord]) -> None:
        """Bring back the pools the journal kept, with the committed blocks of their index files."""
        listed = {f"{r.id}.idx" for r in records}
        for name in os.listdir(self.folder):
            if name.endswith(".idx") and name not in listed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, name))
        for rec in records:
            try:
                geometry = Geometry.from_dict(rec.geometry)
                plan = plan_session(geometry, Mode.DUALBLADE, rec.grant, self.device.lba_size)
                ext = next((x for x in self.allocator.extents if x.owner == rec.id), None) if rec.extents else None
                if (ext is None) != (plan.extent_blocks == 0) or (ext is not None
                                                                   and ext.nblocks != plan.extent_blocks):
                    raise ValueError("its extent does not hold its layout")
                pagecache = PageCacheKPUStore(self.cfg.pagecache_dir, rec.id, plan.pagecache_kpus(),
                                              dir_prefix=RETAINED_DIR_PREFIX)
                pool = self._bind(rec, plan, pagecache, ext, fresh=False)
            except (OSError, ValueError) as e:
                log.warning("block pool %s is not served after the restart: %s; dropping it", rec.id, e)
                self._forget_record(rec)
                continue
            self.pools[rec.id] = pool
            self.manager.ledger.admit(rec.id, plan, fixed=True)
            event("blocks_pool_restore", pool=rec.id, ready=pool.table.gauges()["ready"])

    def _forget_record(self, rec: RetainedRecord) -> None:
        for ext in [x for x in self.allocator.extents if x.owner == rec.id]:
            scrub_and_free(self.device, self.allocator, self.stats, ext, owner=f"block pool {rec.id}",
                           always_zero=self.cfg.device.zero_freed == "always")
        if rec.pagecache_dir:
            shutil.rmtree(rec.pagecache_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._index_path(rec.id))
        self.journal.remove_retained(rec.id)

    def shutdown(self) -> None:
        """A clean stop: attachments closed, every pool's files synced and kept with its journal record."""
        for sess, _ in list(self.attachments.values()):
            self.close(sess)
        for pool in list(self.pools.values()):
            pool.extent_store.close()
            pool.pagecache.close(remove=False)
            pool.table.close()
        self.pools.clear()

    def gauges(self) -> dict[str, int]:
        pools = list(self.pools.values())
        return {"pools": len(pools), "blocks": sum(p.table.gauges()["ready"] for p in pools),
                "pagecache_bytes": sum(p.pagecache_bytes for p in pools),
                "device_bytes": sum(p.device_bytes for p in pools)}


def _keys(body: dict[str, Any]) -> list[bytes]:
    raw = get_field(body, "keys", list)
    if len(raw) > MAX_ITEMS:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field 'keys' names {len(raw)} blocks, more than {MAX_ITEMS}")
    out = []
    for k in raw:
        try:
            b = bytes.fromhex(k) if isinstance(k, str) else None
        except ValueError:
            b = None
        if not b or len(b) > MAX_KEY_BYTES:
            raise RequestError(ErrorCode.BAD_REQUEST, f"field 'keys': {str(k)[:80]!r} is not a block key of 1.."
                                                      f"{MAX_KEY_BYTES} bytes in hex")
        out.append(b)
    return out


def _items(body: dict[str, Any]) -> list[tuple[int, int]]:
    raw = get_field(body, "blocks", list)
    if len(raw) > MAX_ITEMS:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field 'blocks' names {len(raw)} slots, more than {MAX_ITEMS}")
    out = []
    for x in raw:
        if not (isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x)):
            raise RequestError(ErrorCode.BAD_REQUEST, f"field 'blocks': {str(x)[:80]} is not [slot, generation]")
        out.append((x[0], x[1]))
    return out


__all__ = ["ACTIONS", "BlockStore"]
