"""The shared prefix tier: retained prefix blocks on a Redis server several edge boxes use (opt-in).

A block of a retained prefix is one Redis string, keyed by the prefix's scope,
its key seed, the block size and the block's chain hash (which covers every
token before it, so a key names one exact prefix of one model):
``bladed:kv:2:{scope}:{seed}:{block_tokens}:{hash}`` (:meth:`BlockRef.key`).
Its value is a header (magic, format, payload length, crc32c of the payload,
HMAC-SHA256 tag) and the block's token rows of every KPU, KPU after KPU.  The
tag is keyed by the fleet secret (``prefix.shared_secret_file``) and covers
the key, the scope, the whole seed (model, dtype, KV shape and storage format), the block's index
and chain hash and the payload (:func:`mac`): a value is served only under
the key, scope and position it was published for, and only if a box holding
the secret wrote it.  A swapped, copied or forged value is a miss
(``prefix_shared_rejected``), never KV; so is a corrupt or truncated one.

A local ``retain`` publishes its blocks from a background thread; a local
miss (or a shorter local hit) asks the tier for the longest run of leading
blocks it holds and copies them into the session once each one verifies.
Redis's own eviction (``maxmemory-policy allkeys-lru``) bounds the tier; a
block it evicted ends the run.

Nothing here may fail or stall a request: every Redis call has
``prefix.shared_timeout_s``, any error is a miss (``prefix_shared_errors``),
and after an error the tier is skipped for :data:`BACKOFF_S` seconds, so a
dead server costs one timeout, not one per request.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bladed.config import ConfigError, PrefixConfig, read_shared_secrets
from bladed.server.events import event
from bladed.server.metrics import Stats

log = logging.getLogger("bladed.prefix")

#: the value's format and the key's version: a value of another format is never read as this one
FORMAT = 2
KEY_PREFIX = f"bladed:kv:{FORMAT}"
MAGIC = b"bladedkv"
#: header of a block value: magic, format, payload bytes, crc32c of the payload, HMAC-SHA256 tag (56 bytes)
HEADER = struct.Struct("<8sIQI32s")
#: what the tag's message starts with (domain separation from any other use of the secret)
MAC_CONTEXT = b"bladed-shared-kv\0"
#: after a failed call the tier is left alone this long
BACKOFF_S = 5.0


@dataclass(frozen=True)
class BlockRef:
    """Where a block belongs: its scope, key seed, block size, index in the chain and chain hash."""

    scope: str
    seed: bytes
    block_tokens: int
    index: int
    chain_hash: str

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}:{self.scope}:{self.seed.hex()[:32]}:{self.block_tokens}:{self.chain_hash}"


def chain_refs(scope: str, seed: bytes, block_tokens: int, chain: Sequence[str]) -> list[BlockRef]:
    """The :class:`BlockRef` of each block of a chain of block hashes (``prefix.block_chain``)."""
    return [BlockRef(scope, seed, block_tokens, i, h) for i, h in enumerate(chain)]


def _lp(b: bytes) -> bytes:
    """``b`` with its length before it (u32 little-endian): the fields of the tag's message cannot run together."""
    return struct.pack("<I", len(b)) + b


def mac(secret: bytes, ref: BlockRef, payload: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of a block value: ``MAC_CONTEXT || u32 format || lp(key) || lp(scope) || lp(seed) ||
    u32 index || lp(chain hash) || u64 len(payload) || payload`` (``lp``: u32 length, then the bytes)."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    h.update(MAC_CONTEXT + struct.pack("<I", FORMAT) + _lp(ref.key.encode()) + _lp(ref.scope.encode())
             + _lp(ref.seed) + struct.pack("<I", ref.index) + _lp(ref.chain_hash.encode())
             + struct.pack("<Q", len(payload)))
    h.update(payload)
    return h.digest()


def pack(secret: bytes, ref: BlockRef, payload: bytes) -> bytes:
    """The value of ``ref``'s block, signed with ``secret``."""
    import crc32c
    return HEADER.pack(MAGIC, FORMAT, len(payload), crc32c.crc32c(payload), mac(secret, ref, payload)) + payload


class Rejected(ValueError):
    """A value that is not ``ref``'s block: ``reason`` is ``corrupt`` or ``unauthenticated``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def unpack(value: Any, ref: BlockRef, expect: int, secrets: Sequence[bytes]) -> bytes:
    """The payload of ``ref``'s value if it has ``expect`` bytes, its crc32c verifies and its tag does under one of
    ``secrets``; else :class:`Rejected` (``corrupt``: not a whole, intact value of this format; ``unauthenticated``:
    intact, but not signed for this key and position with a secret this box holds)."""
    import crc32c
    if not isinstance(value, bytes | bytearray):
        raise Rejected("corrupt", f"not a string value ({type(value).__name__})")
    if len(value) != HEADER.size + expect:
        raise Rejected("corrupt", f"{len(value)} bytes, {HEADER.size + expect} expected")
    magic, fmt, n, crc, tag = HEADER.unpack_from(value)
    if magic != MAGIC or fmt != FORMAT or n != expect:
        raise Rejected("corrupt", f"not a format-{FORMAT} value of {expect} payload bytes")
    payload = bytes(value[HEADER.size:])
    if crc32c.crc32c(payload) != crc:
        raise Rejected("corrupt", "its crc32c does not match its payload")
    # every secret is tried in full: how long this takes says nothing about which one, if any, came close
    ok = [hmac.compare_digest(mac(s, ref, payload), tag) for s in secrets]
    if not any(ok):
        raise Rejected("unauthenticated", "its tag does not verify for this key and position: swapped, copied "
                                          "from another key, written without the fleet secret, or signed with a "
                                          "secret this box no longer holds")
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
        try:
            #: the current secret (signs and verifies), then the previous one if any (verifies: a rotation's rollout)
            self.secrets = read_shared_secrets(cfg.shared_secret_file)
        except ValueError as e:  # load_config checked it; this is the file changed since
            raise ConfigError([f"prefix.shared_secret_file: {e}"]) from None
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
    def fetch(self, refs: Sequence[BlockRef], block_bytes: int) -> list[bytes]:
        """The payloads of the longest run of leading ``refs`` the tier holds, each verified ([] on any trouble)."""
        if not refs or not self._usable():
            return []
        keys = [r.key for r in refs]
        try:
            with self.client.pipeline(transaction=False) as p:
                for k in keys:
                    p.exists(k)
                present = p.execute()
            run = next((i for i, hit in enumerate(present) if not hit), len(keys))
            if not run:
                return []
            values = self.client.mget(keys[:run])
        except self._errors as e:
            self._failed("a lookup", e)
            return []
        out = []
        for ref, v in zip(refs[:run], values, strict=True):
            try:
                out.append(unpack(v, ref, block_bytes, self.secrets))
            except Rejected as e:
                # a miss from here on, never wrong KV
                log.warning("shared prefix tier: block %d (%s) is refused (%s: %s); using the blocks before it",
                            ref.index, ref.key, e.reason, e)
                self.stats.add("prefix_shared_rejected")
                break
        return out

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, items: list[tuple[BlockRef, bytes]]) -> None:
        """Publish ``(ref, payload)`` blocks, signed with the current secret, from a background thread (the retain
        does not wait)."""
        t = threading.Thread(target=self._publish, args=(items,), name="bladed-prefix-publish", daemon=True)
        with self._lock:
            self._publishers = [p for p in self._publishers if p.is_alive()] + [t]
        t.start()

    def _publish(self, items: list[tuple[BlockRef, bytes]]) -> None:
        if not self._usable():
            return
        try:
            with self.client.pipeline(transaction=False) as p:
                for ref, payload in items:
                    p.set(ref.key, pack(self.secrets[0], ref, payload))
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


__all__ = ["BlockRef", "Rejected", "SharedTier", "chain_refs", "mac", "pack", "unpack"]
