"""The shared prefix tier: retained prefix blocks on a Redis server several edge boxes use (opt-in).

A block of a retained prefix is one Redis string, keyed by the prefix's scope,
its key seed, the block size and the block's chain hash (which covers every
token before it, so a key names one exact prefix of one model):
``bladed:kv:1:{scope}:{seed}:{block_tokens}:{hash}``.  Its value is a header
(magic, payload length, crc32c of the payload) and the block's token rows of
every KPU, KPU after KPU.  A local ``retain`` publishes its blocks from a
background thread; a local miss (or a shorter local hit) asks the tier for
the longest run of leading blocks it holds and copies them into the session
once each one's length and crc32c verify.  Redis's own eviction
(``maxmemory-policy allkeys-lru``) bounds the tier; a block it evicted ends
the run.

Nothing here may fail or stall a request: every Redis call has
``prefix.shared_timeout_s``, any error is a miss (``prefix_shared_errors``),
and after an error the tier is skipped for :data:`BACKOFF_S` seconds, so a
dead server costs one timeout, not one per request.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from bladed.config import PrefixConfig
from bladed.server.events import event
from bladed.server.metrics import Stats

log = logging.getLogger("bladed.prefix")

#: header of a block value: magic, payload bytes, crc32c of the payload
HEADER = struct.Struct("<8sQI")
MAGIC = b"bladedkv"
#: after a failed call the tier is left alone this long
BACKOFF_S = 5.0
KEY_PREFIX = "bladed:kv:1"


def block_key(scope: str, seed_hex: str, block_tokens: int, block_hash: str) -> str:
    return f"{KEY_PREFIX}:{scope}:{seed_hex[:32]}:{block_tokens}:{block_hash}"


def pack(payload: bytes) -> bytes:
    import crc32c
    return HEADER.pack(MAGIC, len(payload), crc32c.crc32c(payload)) + payload


def unpack(value: Any, expect: int) -> bytes | None:
    """The payload of a block value, or None if it is not one of ``expect`` bytes whose crc32c verifies."""
    import crc32c
    if not isinstance(value, bytes | bytearray) or len(value) != HEADER.size + expect:
        return None
    magic, n, crc = HEADER.unpack_from(value)
    payload = bytes(value[HEADER.size:])
    if magic != MAGIC or n != expect or crc32c.crc32c(payload) != crc:
        return None
    return payload


def _password(path: str) -> tuple[str | None, str | None]:
    """``(username, password)`` from a credential file: ``password`` or ``user:password`` on its first line."""
    with open(path) as f:
        line = f.readline().strip()
    user, sep, password = line.partition(":")
    return (user, password) if sep else (None, line)


class SharedTier:
    """A Redis server holding retained prefix blocks for several daemons."""

    def __init__(self, cfg: PrefixConfig, stats: Stats) -> None:
        import redis  # the optional dependency (pip install 'bladed[shared]'), only when the tier is on

        self.stats = stats
        self.timeout = cfg.shared_timeout_s
        user, password = _password(cfg.shared_credentials) if cfg.shared_credentials else (None, None)
        opts: dict[str, Any] = {"socket_timeout": self.timeout, "socket_connect_timeout": self.timeout,
                                "retry_on_timeout": False, "username": user, "password": password}
        if cfg.shared_tls_ca:
            opts["ssl_ca_certs"] = cfg.shared_tls_ca
        self.client = redis.Redis.from_url(cfg.shared_url, **opts)
        self._errors = (redis.RedisError, OSError)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._publishers: list[threading.Thread] = []

    # -- failure handling --------------------------------------------------------------------
    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: BaseException) -> None:
        self.stats.add("prefix_shared_errors")
        first = self._usable()
        self._down_until = time.monotonic() + BACKOFF_S
        (log.warning if first else log.debug)("shared prefix tier: %s failed (%s); not asked for %.0f s",
                                              what, e, BACKOFF_S)

    # -- lookup -----------------------------------------------------------------------------
    def fetch(self, keys: Sequence[str], block_bytes: int) -> list[bytes]:
        """The payloads of the longest run of leading ``keys`` the tier holds intact ([] on any trouble)."""
        if not keys or not self._usable():
            return []
        try:
            with self.client.pipeline(transaction=False) as p:
                for k in keys:
                    p.exists(k)
                present = p.execute()
            run = next((i for i, hit in enumerate(present) if not hit), len(keys))
            if not run:
                return []
            values = self.client.mget(list(keys[:run]))
        except self._errors as e:
            self._failed("a lookup", e)
            return []
        out = []
        for k, v in zip(keys[:run], values, strict=True):
            payload = unpack(v, block_bytes)
            if payload is None:
                # truncated, corrupt or of another layout: a miss from here on, never wrong KV
                log.warning("shared prefix tier: block %s does not verify; using the blocks before it", k)
                self.stats.add("prefix_shared_rejected")
                break
            out.append(payload)
        return out

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, items: list[tuple[str, bytes]]) -> None:
        """Publish ``(key, payload)`` blocks from a background thread (the retain does not wait)."""
        t = threading.Thread(target=self._publish, args=(items,), name="bladed-prefix-publish", daemon=True)
        with self._lock:
            self._publishers = [p for p in self._publishers if p.is_alive()] + [t]
        t.start()

    def _publish(self, items: list[tuple[str, bytes]]) -> None:
        if not self._usable():
            return
        try:
            with self.client.pipeline(transaction=False) as p:
                for key, payload in items:
                    p.set(key, pack(payload))
                p.execute()
        except self._errors as e:
            self._failed("a publish", e)
            return
        self.stats.add("prefix_shared_published", len(items))
        event("prefix_publish", blocks=len(items), bytes=sum(len(v) for _, v in items))

    def close(self) -> None:
        """Let the publishes in flight finish (each bounded by the timeout), then drop the connection."""
        with self._lock:
            pending, self._publishers = self._publishers, []
        for t in pending:
            t.join(self.timeout * 4 + 1)
        self.client.close()


__all__ = ["SharedTier", "block_key", "pack", "unpack"]
