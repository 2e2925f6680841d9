"""The retained entries of one daemon by id: matching a chain, who is copying out of which, and eviction
(least recently used first).  Releasing an evicted entry's storage is the cache's (``drop``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from bladed.protocol import ErrorCode, RequestError
from bladed.server.events import event
from bladed.server.metrics import Stats
from bladed.server.prefixes.entry import RetainedPrefix


class PrefixIndex:
    """Entries by id, under one lock; ``drop(entry, reason)`` scrubs an evicted entry's storage."""

    def __init__(self, stats: Stats, drop: Callable[[RetainedPrefix, str], None]) -> None:
        self.stats = stats
        self._drop = drop
        self.entries: dict[str, RetainedPrefix] = {}
        self.lock = threading.Lock()

    # -- figures ------------------------------------------------------------------------------
    @property
    def pagecache_bytes(self) -> int:
        with self.lock:
            return sum(e.pagecache_bytes for e in self.entries.values())

    def cached_bytes(self) -> int:
        """Bytes of the entries' page-cache files now in the page cache (measured, not planned)."""
        with self.lock:
            entries = list(self.entries.values())
        return sum(e.pagecache.cached_bytes() for e in entries)

    @property
    def device_bytes(self) -> int:
        with self.lock:
            return sum(e.device_bytes for e in self.entries.values())

    def gauges(self) -> dict[str, int]:
        with self.lock:
            return {"entries": len(self.entries), "tokens": sum(e.tokens for e in self.entries.values()),
                    "pagecache_bytes": sum(e.pagecache_bytes for e in self.entries.values()),
                    "device_bytes": sum(e.device_bytes for e in self.entries.values())}

    def matching(self, keep: Callable[[RetainedPrefix], bool]) -> list[RetainedPrefix]:
        with self.lock:
            return [e for e in self.entries.values() if keep(e)]

    def add(self, entry: RetainedPrefix) -> None:
        with self.lock:
            self.entries[entry.id] = entry

    def take_all(self) -> list[RetainedPrefix]:
        """Every entry, the index left empty (a clean stop)."""
        with self.lock:
            entries, self.entries = list(self.entries.values()), {}
        return entries

    # -- matching and use ------------------------------------------------------------------------
    def acquire(self, scope: str, seed_hex: str, block_tokens: int,
                chain: list[str]) -> tuple[RetainedPrefix | None, int]:
        """The entry of ``scope`` sharing the most leading blocks with ``chain`` (held against eviction until
        :meth:`release`), and how many blocks it shares."""
        best: RetainedPrefix | None = None
        best_n = 0
        with self.lock:
            for e in self.entries.values():
                if not e.matches(scope, seed_hex, block_tokens):
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

    def release(self, entry: RetainedPrefix) -> None:
        """A copy out of ``entry`` is done (a condemned entry is dropped by its last user)."""
        with self.lock:
            entry.users -= 1
            last = entry.bad and entry.users == 0
        if last:
            self._drop(entry, "condemned")

    # -- eviction ---------------------------------------------------------------------------------
    def evict(self, entry: RetainedPrefix, reason: str) -> bool:
        """Remove an entry and scrub its storage; False if it is gone or in use."""
        with self.lock:
            if self.entries.get(entry.id) is not entry or entry.users:
                return False
            del self.entries[entry.id]
        self._drop(entry, reason)
        self.stats.count("prefix_evictions", reason)
        event("prefix_evict", entry=entry.id, reason=reason, tokens=entry.tokens, hits=entry.hits)
        return True

    def evict_lru(self, reason: str, which: Callable[[RetainedPrefix], bool] = lambda e: True) -> bool:
        """Evict the least recently used entry not in use that ``which`` accepts; False if there is none."""
        with self.lock:
            idle = [e for e in self.entries.values() if e.users == 0 and which(e)]
            if not idle:
                return False
            victim = min(idle, key=lambda e: e.last_used)
        self.evict(victim, reason)
        return True

    def evict_until(self, done: Callable[[], bool], reason: str) -> None:
        while not done() and self.evict_lru(reason):
            pass

    def condemn(self, entry: RetainedPrefix, reason: str) -> None:
        """An entry found bad while a copy holds it: out of the index now, dropped by its last user."""
        with self.lock:
            if self.entries.get(entry.id) is entry:
                del self.entries[entry.id]
            entry.bad = True
        self.stats.count("prefix_evictions", reason)
        event("prefix_evict", entry=entry.id, reason=reason, tokens=entry.tokens, hits=entry.hits)

    def evict_matching(self, visible: Callable[[RetainedPrefix], bool], entry_id: str | None) -> list[str]:
        """``evict_prefixes``: one entry by id, or all that are ``visible``; the ids evicted."""
        targets = self.matching(lambda e: visible(e) and (entry_id is None or e.id == entry_id))
        if entry_id is not None and not targets:
            # the same answer whether it does not exist or is another scope's: no probing
            raise RequestError(ErrorCode.BAD_REQUEST, f"no retained prefix {entry_id!r} (see bladectl prefixes)")
        done = [e.id for e in targets if self.evict(e, "requested")]
        busy = [e.id for e in targets if e.id not in done]
        if entry_id is not None and busy:
            raise RequestError(ErrorCode.BUSY, f"retained prefix {entry_id} is being copied into a session; retry")
        return done


__all__ = ["PrefixIndex"]
