"""Where an offloaded KV cache lives: the ``KVBackend`` protocol, shared by the
runner (``bladed.runner``) and the transformers cache (``bladed.hf``).

A backend exposes per-channel staging slots (one per copy thread) whose layout
mirrors one KPU of shape ``(max_tokens, batch * kv_heads, head_dim)``
row-major, and moves token ranges of a layer's K or V between a slot and the
store. Two implementations:

* ``MemoryKV``: the store is process memory (the reference).
* ``BladedKV``: a ``bladed.client`` session; the slots are the daemon-shared
  staging memory, and the daemon places each KPU on the page-cache or the
  NVMe-direct path.

``bladed.slots`` gives torch views over a backend's slots (``SlotTensors``: copy threads move K/V between
torch tensors and a slot with one ``copy_``, in the slot's KV format, with the full-precision tail) and reads
a sparse step's selected pages through them (``PageReader``).

KV formats (``bladed.kvformat``): a geometry's ``kv_format`` says how a token
row is stored. ``""`` (the default) stores the tensors' own elements, as
bladed always did; a named format stores that format's rows (``fp16``,
``bf16``, ``fp32``: the elements converted to it; ``q8``, ``q4``: quantized).
The backends move the rows as bytes, so ``MemoryKV`` and ``BladedKV`` of one
geometry hold the same bytes and give the same tensors back.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from bladed.kvformat import KVFormat, kv_format
from bladed.residency.geometry import Geometry, tensor_id
from bladed.residency.geometry import dtype_bytes as geometry_dtype_bytes

Kind = Literal["k", "v"]

#: the KV dtypes the torch views of a staging slot support (their sizes: the one dtype table)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a KV dtype (ValueError naming the supported ones for any other)."""
    if dtype not in KV_DTYPES:
        known = ", ".join(str(d).removeprefix("torch.") for d in KV_DTYPES)
        raise ValueError(f"KV dtype {dtype} is not supported; use one of {known}")
    return geometry_dtype_bytes(dtype)


#: the plain formats' elements, by canonical name: their rows are these elements, no encoding but the dtype's
PLAIN_FORMAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def plain_dtype(fmt: KVFormat | None) -> torch.dtype | None:
    """The element dtype of a plain format (``fp16``, ``bf16``, ``fp32``); None for a quantized one or none."""
    return None if fmt is None else PLAIN_FORMAT_DTYPES.get(fmt.name)


def stored_format(geometry: Geometry) -> KVFormat | None:
    """The format of ``geometry``'s token rows; None for rows of its own elements (``kv_format`` ``""``)."""
    return kv_format(geometry.kv_format) if geometry.kv_format else None


def kv_geometry(*, layers: int, batch: int, kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype,
                kv_format: str | KVFormat | None = None) -> Geometry:
    """The geometry of a KV cache of ``dtype`` tensors whose rows are stored as ``kv_format``.

    ``kv_format`` None or ``""``: rows of ``dtype``'s own elements, unnamed (what bladed always stored). A plain
    format (``fp16``, ``bf16``, ``fp32``) stores its own elements: the geometry's ``dtype_bytes`` is theirs
    (fp16 rows of a float32 model are 2 bytes an element). A quantized one (``q8``, ``q4``) keeps ``dtype``'s
    size as ``dtype_bytes`` (what the rows decode to). ``KVFormatError`` (a ValueError) for an unknown name or a
    ``head_dim`` the format cannot store.
    """
    fmt = _format_of(kv_format)
    plain = plain_dtype(fmt)
    size = plain.itemsize if plain is not None else dtype_bytes(dtype)
    return Geometry(layers=layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=size,
                    max_tokens=max_tokens, kv_format=fmt.name if fmt is not None else "")


def prefix_key_fields(model: str, dtype: torch.dtype, kv_format: str | KVFormat | None = None) -> tuple[str, str]:
    """``(model, dtype)`` of a ``bladed.client.PrefixKey`` for KV computed in ``dtype`` and stored as ``kv_format``.

    The key's dtype must have the geometry's element size (:func:`kv_geometry`): ``dtype`` itself, but the
    format's own dtype for a plain format of other elements (fp16 rows of a float32 model); the computing dtype
    is then added to the model's name (``model+float32``), so that such KV is never served to a run computing in
    the format's dtype. bladed itself keys an entry by the format as well (a miss across formats).
    """
    name = str(dtype).removeprefix("torch.")
    plain = plain_dtype(_format_of(kv_format))
    if plain is not None and plain != dtype:
        return f"{model}+{name}", str(plain).removeprefix("torch.")
    return model, name


def full_precision_tail(fmt: str | KVFormat | None, kv_tail: int | None = None) -> int:
    """The tokens a client attends to at full precision from its own memory: ``kv_tail`` if given (0: none),
    else the format's :attr:`KVFormat.full_precision_tail` (0 without a format). ValueError, one line, for a
    negative ``kv_tail``."""
    if kv_tail is not None:
        if isinstance(kv_tail, bool) or not isinstance(kv_tail, int) or kv_tail < 0:
            raise ValueError(f"kv_tail={kv_tail!r}: the full-precision tail is a number of tokens, 0 or more "
                             "(0 turns it off; leave it out for the format's own)")
        return kv_tail
    f = _format_of(fmt) if not isinstance(fmt, KVFormat) else fmt
    return f.full_precision_tail if f is not None else 0


def _format_of(spec: str | KVFormat | None) -> KVFormat | None:
    return None if spec is None or spec == "" else kv_format(spec)


@dataclass
class KVOp:
    """What one read or write did (the client's ``OpResult`` has the same fields)."""

    path: str
    nbytes: int
    service_ns: int
    hit_ratio: float | None = None


def combined_op(results: list[Any]) -> KVOp:
    """Several ranges' results (``OpResult``, :class:`KVOp`) as one: the bytes and the daemon's seconds summed,
    the hit ratio weighted by bytes (None where none is known), the first one's path."""
    nbytes = sum(int(r.nbytes) for r in results)
    known = [r for r in results if r.hit_ratio is not None]
    seen = sum(int(r.nbytes) for r in known)
    hit = sum(float(r.hit_ratio) * int(r.nbytes) for r in known) / seen if known and seen else None
    return KVOp(str(results[0].path) if results else "?", nbytes, sum(int(r.service_ns or 0) for r in results), hit)


@runtime_checkable
class KVBackend(Protocol):
    geometry: Geometry

    @property
    def channels(self) -> int: ...

    def slot(self, ch: int) -> memoryview: ...

    def group(self, layer: int, kind: Kind) -> int: ...

    def write(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
              ntokens: int | None = None) -> Any: ...

    def read(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
             ntokens: int | None = None) -> Any: ...

    def close(self) -> None: ...


@dataclass
class PathStats:
    """Per-path counters aggregated from the ops' results."""

    read_ops: int = 0
    read_bytes: int = 0
    read_ns: int = 0
    write_ops: int = 0
    write_bytes: int = 0
    write_ns: int = 0
    hit_bytes: float = 0.0
    hit_known_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "read_ops": self.read_ops, "read_bytes": self.read_bytes,
            "read_GBps": _gbps(self.read_bytes, self.read_ns),
            "write_ops": self.write_ops, "write_bytes": self.write_bytes,
            "write_GBps": _gbps(self.write_bytes, self.write_ns),
        }
        if self.hit_known_bytes:
            d["hit_ratio"] = round(self.hit_bytes / self.hit_known_bytes, 4)
        return d


def _gbps(nbytes: int, ns: int) -> float | None:
    return round(nbytes / ns, 3) if ns > 0 else None


@dataclass
class StatsBook:
    """Thread-safe per-path aggregation of op results."""

    paths: dict[str, PathStats] = field(default_factory=lambda: defaultdict(PathStats))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: Any, is_read: bool) -> None:
        path = str(getattr(op, "path", "?"))
        nbytes = int(getattr(op, "nbytes", 0))
        ns = int(getattr(op, "service_ns", 0) or 0)
        hr = getattr(op, "hit_ratio", None)
        with self._lock:
            s = self.paths[path]
            if is_read:
                s.read_ops += 1
                s.read_bytes += nbytes
                s.read_ns += ns
                if hr is not None:
                    s.hit_bytes += float(hr) * nbytes
                    s.hit_known_bytes += nbytes
            else:
                s.write_ops += 1
                s.write_bytes += nbytes
                s.write_ns += ns

    def as_dict(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {p: s.as_dict() for p, s in sorted(self.paths.items())}


class MemoryKV:
    """The reference backend: every KPU is a buffer in this process.

    It keeps the slot's bytes, so a geometry with a ``kv_format`` holds that format's rows (``token_bytes`` of
    them per token), the same bytes a bladed session of that geometry stores. ``kv_tail``: the full-precision
    tail ``bladed.slots.SlotTensors`` over it keeps (None: the format's; 0: off; :func:`full_precision_tail`).
    """

    def __init__(self, geometry: Geometry, channels: int = 2, groups: dict[int, int] | None = None, *,
                 kv_tail: int | None = None) -> None:
        self.geometry = geometry
        self.kv_format = stored_format(geometry)
        #: the full-precision tail of the clients over this backend (:func:`full_precision_tail`)
        self.kv_tail = full_precision_tail(self.kv_format, kv_tail)
        self._channels = channels
        # page-aligned memory of its own per slot (anonymous mappings, not bytearrays that may share a page):
        # on CUDA the runner page-locks each slot, and a second registration of a shared page would fail
        self._slots = [mmap.mmap(-1, geometry.kpu_bytes) for _ in range(channels)]
        self._store: dict[tuple[int, str], bytearray] = {}
        self._groups = groups or {}

    @property
    def channels(self) -> int:
        return self._channels

    def slot(self, ch: int) -> memoryview:
        return memoryview(self._slots[ch])

    def group(self, layer: int, kind: Kind) -> int:
        return self._groups.get(layer, 1)

    def _span(self, token_start: int, ntokens: int | None) -> tuple[int, int]:
        g = self.geometry
        n = g.max_tokens - token_start if ntokens is None else ntokens
        if token_start < 0 or n < 0 or token_start + n > g.max_tokens:
            raise ValueError(f"tokens [{token_start}, {token_start + n}) outside [0, {g.max_tokens})")
        return token_start * g.token_bytes, n * g.token_bytes

    def _kpu(self, layer: int, kind: Kind) -> bytearray:
        if not 0 <= layer < self.geometry.layers or kind not in ("k", "v"):
            raise ValueError(f"no KPU ({layer}, {kind!r})")
        key = (layer, kind)
        buf = self._store.get(key)
        if buf is None:
            buf = self._store[key] = bytearray(self.geometry.kpu_bytes)
        return buf

    def write(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
              ntokens: int | None = None) -> KVOp:
        off, n = self._span(token_start, ntokens)
        t0 = time.perf_counter_ns()
        self._kpu(layer, kind)[off:off + n] = self._slots[ch][off:off + n]
        return KVOp("memory", n, time.perf_counter_ns() - t0, None)

    def read(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
             ntokens: int | None = None) -> KVOp:
        off, n = self._span(token_start, ntokens)
        t0 = time.perf_counter_ns()
        memoryview(self._slots[ch])[off:off + n] = memoryview(self._kpu(layer, kind))[off:off + n]
        return KVOp("memory", n, time.perf_counter_ns() - t0, 1.0)

    def read_runs(self, layer: int, kind: Kind, ch: int, runs: list[tuple[int, int]]) -> KVOp:
        """Read several token ranges ``(token_start, ntokens)`` of one KPU into the slot (mirrored offsets)."""
        t0 = time.perf_counter_ns()
        total = 0
        for start, n in runs:
            total += self.read(layer, kind, ch, start, n).nbytes
        return KVOp("memory", total, time.perf_counter_ns() - t0, 1.0)

    def close(self) -> None:
        self._store.clear()


#: token rows a channel's slot keeps aside for deferred writes (``BladedKV(defer_writes=True)``)
DEFER_ROWS = 4


class BladedKV:
    """A ``bladed.client`` session as a KV backend.

    ``session`` is an open ``Session``; ``geometry`` must be the one it was
    opened with. Use :meth:`open` to open the session from a client.

    The geometry's ``kv_format`` is the session's (the daemon sizes the rows by it): the slots hold that
    format's rows, which ``bladed.slots.SlotTensors`` encodes and decodes; a session whose rows are not the
    geometry's size (a daemon that does not know KV formats) is refused with ValueError.

    With ``defer_writes`` a small write (a decode step's append) is not sent
    at once: its rows are copied to a spare area at the end of the channel's
    slot (``DEFER_ROWS`` rows; the KPU-shaped part of the slot is free for the
    next copy at once) and the channel's next read carries the write in the
    same batched request: one request per channel and layer instead of two.
    A read or a write of a KPU with a write pending sends that write first; a full
    spare area, a large write, :meth:`flush` and :meth:`close` send what is pending.
    For callers that do not wait for their writes anyway (the runner with
    ``overlap``): a failed deferred write raises at the request that carried
    it.

    Opened with a ``prefix`` key (``bladed.client.PrefixKey``), the session may
    start with the KV of a retained prefix (:attr:`prefix_tokens`), and
    :meth:`retain` keeps the session's KV as one when the run is over.

    ``kv_tail``: the full-precision tail ``bladed.slots.SlotTensors`` over it keeps in this process (None: the
    format's, ``q4``: 128; 0: off; :func:`full_precision_tail`); the session stores every row all the same.
    """

    def __init__(self, session: Any, geometry: Geometry, owns_client: Any = None, *,
                 defer_writes: bool = False, kv_tail: int | None = None) -> None:
        self.session = session
        self.geometry = geometry
        self.kv_format = stored_format(geometry)
        #: the full-precision tail of the clients over this backend (:func:`full_precision_tail`)
        self.kv_tail = full_precision_tail(self.kv_format, kv_tail)
        self._client = owns_client
        rows = getattr(session, "token_bytes", None)
        if isinstance(rows, int) and rows != geometry.token_bytes:
            what = f"{geometry.kv_format} rows" if geometry.kv_format else "rows"
            raise ValueError(f"the bladed session has token rows of {rows} bytes, the geometry's {what} are "
                             f"{geometry.token_bytes} bytes; open the session with this geometry (a daemon that "
                             "does not know KV formats ignores kv_format: upgrade it)")
        self._groups: dict[tuple[int, str], int] = {}
        self._paths: dict[tuple[int, str], str] = {}
        plan = getattr(session, "plan", None) or {}
        for kpu in plan.get("kpus", []) if isinstance(plan, dict) else []:
            try:
                key = (int(kpu["layer"]), str(kpu["kind"]))
                self._groups[key] = int(kpu["group"])
                self._paths[key] = str(kpu["path"])
            except (KeyError, TypeError, ValueError):
                continue
        self._nslots = int(getattr(session, "channels", 0) or 0)
        tb = geometry.token_bytes
        spare = int(getattr(session, "slot_bytes", 0) or 0) - geometry.kpu_bytes
        self.defer_writes = defer_writes and spare >= tb
        self._spare_rows = spare // tb if self.defer_writes else 0
        self._deferred: list[list[Any]] = [[] for _ in range(self._nslots)]
        self._spare_used = [0] * self._nslots

    @classmethod
    def open(cls, geometry: Geometry, mode: str = "dualblade", channels: int = 2,
             socket_path: str | None = None, client: Any = None, *, defer_writes: bool = False,
             prefix: Any = None, kv_tail: int | None = None) -> BladedKV:
        """Open a session; ``prefix``: a ``PrefixKey`` to start from the longest retained prefix of its tokens."""
        from bladed import client as bclient  # floor 2: only the client library

        full_precision_tail(geometry.kv_format, kv_tail)   # a bad kv_tail before a session is opened
        own = None
        if client is None:
            client = own = bclient.Client(socket_path=socket_path)
        slot = geometry.kpu_bytes + (DEFER_ROWS * geometry.token_bytes if defer_writes else 0)
        try:
            sess = client.open_session(geometry, mode=mode, channels=channels, slot_bytes=slot, prefix=prefix)
        except BaseException:
            if own is not None:
                own.close()
            raise
        try:
            return cls(sess, geometry, owns_client=own, defer_writes=defer_writes, kv_tail=kv_tail)
        except BaseException:
            try:
                sess.close()
            finally:
                if own is not None:
                    own.close()
            raise

    @property
    def prefix_tokens(self) -> int:
        """Leading tokens whose KV a retained prefix put in the session at open (0: none)."""
        return int(getattr(self.session, "prefix_tokens", 0) or 0)

    def retain(self, tokens: list[int]) -> dict[str, Any]:
        """Send the deferred writes, then keep the KV of the first whole blocks of ``tokens`` (the ids of the
        token rows written, from token 0) as a retained prefix and close the session with it.

        Returns the daemon's ``{"entry", "tokens", "new"}``; ``{"entry": None, "tokens": 0, "new": False,
        "skipped": why}`` when nothing was kept (fewer tokens than a block, retention off or over its quota);
        the session then stays open for :meth:`close`.
        """
        from bladed.protocol import QuotaExceededError

        self.flush()
        block = self.session.prefix_block_tokens or int(self.session.client.prefixes()["block_tokens"])
        if len(tokens) < block:
            why = f"{len(tokens)} tokens, fewer than one block of {block} (prefix.block_tokens)"
            return {"entry": None, "tokens": 0, "new": False, "skipped": why}
        try:
            return dict(self.session.retain(tokens, close=True))
        except QuotaExceededError as e:
            return {"entry": None, "tokens": 0, "new": False, "skipped": str(e)}

    prepinned = True  # the client registers the staging mapping with CUDA itself

    @property
    def channels(self) -> int:
        return self._nslots

    @property
    def plan(self) -> dict[str, Any]:
        return dict(getattr(self.session, "plan", None) or {})

    def slot(self, ch: int) -> memoryview:
        return self.session.slot(ch)  # type: ignore[no-any-return,unused-ignore]

    def group(self, layer: int, kind: Kind) -> int:
        return self._groups.get((layer, kind), 2)

    def write(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
              ntokens: int | None = None) -> Any:
        n = self.geometry.max_tokens - token_start if ntokens is None else ntokens
        if not self.defer_writes or n > self._spare_rows:
            self.flush(ch)
            return self.session.write(layer, kind, ch, token_start=token_start, ntokens=ntokens)
        tid = tensor_id(layer, kind)
        # a request names each KPU once: a second append of a KPU sends the first one before it is deferred
        if self._spare_used[ch] + n > self._spare_rows or any(w.tensor_id == tid for w in self._deferred[ch]):
            self.flush(ch)
        tb, kpu = self.geometry.token_bytes, self.geometry.kpu_bytes
        at = kpu + self._spare_used[ch] * tb
        slot = self.session.slot(ch)
        slot[at:at + n * tb] = slot[token_start * tb:(token_start + n) * tb]
        self._spare_used[ch] += n
        self._deferred[ch].append(self.session.range("write", layer, kind, token_start, n, slot_offset=at))
        # what the write will do; its outcome arrives with the channel's next request
        return KVOp(self._paths.get((layer, kind), "?"), n * tb, 0, None)

    def read(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
             ntokens: int | None = None) -> Any:
        pending = self._deferred[ch] if self.defer_writes else None
        if not pending:
            return self.session.read(layer, kind, ch, token_start=token_start, ntokens=ntokens)
        rng = self.session.range("read", layer, kind, token_start, ntokens)
        if any(w.tensor_id == rng.tensor_id for w in pending):
            self.flush(ch)                       # a request names each KPU once: the write goes first
            return self.session.read(layer, kind, ch, token_start=token_start, ntokens=ntokens)
        self._deferred[ch], self._spare_used[ch] = [], 0
        return self.session.submit(ch, [*pending, rng])[-1]

    def read_runs(self, layer: int, kind: Kind, ch: int, runs: list[tuple[int, int]]) -> KVOp:
        """Read several token ranges ``(token_start, ntokens)`` of one KPU into the slot (mirrored offsets): one
        request for them all (protocol 6; more than ``max_ranges`` of them in several, pipelined), so the daemon
        submits a direct KPU's runs to the device together; the deferred writes riding on the first. One
        :class:`KVOp` for them all (its ``service_ns`` the daemon's, summed)."""
        if not runs:
            return KVOp(self._paths.get((layer, kind), "?"), 0, 0, None)
        ranges = [self.session.range("read", layer, kind, start, n) for start, n in runs]
        limit = self.session.client.max_ranges
        pending = self._deferred[ch] if self.defer_writes else None
        if pending:
            tid = tensor_id(layer, kind)
            if any(w.tensor_id == tid for w in pending) or len(pending) + min(len(ranges), limit) > limit:
                self.flush(ch)                   # the write goes first, in a request of its own
            else:
                ranges = [*pending, *ranges]
                self._deferred[ch], self._spare_used[ch] = [], 0
        results = [r for reply in self.session.submit_many(ch, self.session.requests_of(ranges)) for r in reply]
        return combined_op([r for r in results if r.op == "read"])

    def flush(self, ch: int | None = None) -> None:
        """Send the deferred writes of channel ``ch`` (default: every channel)."""
        for c in range(self._nslots) if ch is None else (ch,):
            pending, self._deferred[c], self._spare_used[c] = self._deferred[c], [], 0
            if pending:
                self.session.submit(c, pending)

    def close(self) -> None:
        try:
            try:
                self.flush()
            finally:
                self.session.close()
        finally:
            if self._client is not None:
                self._client.close()
                self._client = None


__all__ = [
    "PLAIN_FORMAT_DTYPES",
    "BladedKV",
    "Geometry",
    "KVBackend",
    "KVOp",
    "Kind",
    "MemoryKV",
    "PathStats",
    "StatsBook",
    "combined_op",
    "dtype_bytes",
    "full_precision_tail",
    "kv_geometry",
    "plain_dtype",
    "prefix_key_fields",
    "stored_format",
]
