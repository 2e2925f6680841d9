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

``SlotTensors`` gives torch views over a backend's slots, so copy threads move
K/V between torch tensors and a slot with one ``copy_``.

KV formats (``bladed.kvformat``): a geometry's ``kv_format`` says how a token
row is stored. ``""`` (the default) stores the tensors' own elements, as
bladed always did; a named format stores that format's rows (``fp16``,
``bf16``, ``fp32``: the elements converted to it; ``q8``, ``q4``: quantized).
``SlotTensors`` encodes K/V into the slot's rows and decodes them back into
the caller's dtype, in this process and on the tensor's device; the backends
move the rows as bytes, so ``MemoryKV`` and ``BladedKV`` of one geometry hold
the same bytes and give the same tensors back.

Full-precision tail (``KVFormat.full_precision_tail``: 128 for ``q4``, 0 for the others): ``SlotTensors``
keeps, per layer and K/V, a ring of the last ``tail`` tokens it wrote, in the caller's dtype on the tensor's
device, and a read of a KPU's tokens gives the newest ``min(tail, n)`` of them from that ring instead of
their decoded rows (the rows are written all the same); what ``tools/bench_kv_accuracy.py`` measured. It
costs ``2 * layers * tail * row_elems * dtype size`` of memory per ``SlotTensors``. ``kv_tail`` (of
``SlotTensors``, ``MemoryKV``, ``BladedKV``) overrides the format's, 0 turns it off.
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
from bladed.kvselect import ReuseBuffer, SelectionState, pages_of, runs_of, token_index
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
    tail :class:`SlotTensors` over it keeps (None: the format's; 0: off; :func:`full_precision_tail`).
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
    format's rows, which :class:`SlotTensors` encodes and decodes; a session whose rows are not the
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

    ``kv_tail``: the full-precision tail :class:`SlotTensors` over it keeps in this process (None: the
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
        limit = max(1, int(self.session.client.server.get("max_ranges", len(ranges))))
        pending = self._deferred[ch] if self.defer_writes else None
        if pending:
            tid = tensor_id(layer, kind)
            if any(w.tensor_id == tid for w in pending) or len(pending) + min(len(ranges), limit) > limit:
                self.flush(ch)                   # the write goes first, in a request of its own
            else:
                ranges = [*pending, *ranges]
                self._deferred[ch], self._spare_used[ch] = [], 0
        requests = [ranges[i:i + limit] for i in range(0, len(ranges), limit)]
        results = [r for reply in self.session.submit_many(ch, requests) for r in reply]
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


class SlotTensors:
    """Torch views over a backend's staging slots, and the K/V tensors they hold.

    ``dtype`` is the K/V tensors' dtype. Without a ``kv_format`` (the default) a slot is a KPU-shaped tensor
    of ``dtype``, ``[max_tokens, batch, kv_heads, head_dim]`` (:attr:`views`), and :meth:`put` / :meth:`take`
    copy tensors in and out with one ``copy_`` each. With a format, :meth:`put` encodes the tensor into the
    slot's token rows (:attr:`rows`, uint8 ``[max_tokens, token_bytes]``) and :meth:`take` decodes them into
    ``dtype``, on the tensor's device: a plain format (``fp16``, ``bf16``, ``fp32``) converts in the same
    ``copy_`` (the slot views are of its dtype); a quantized one encodes straight into the slot's rows when
    the tensor is in host memory, else on its device and copies the encoded rows (fewer bytes than the
    tensor) to the slot, and decodes on the target device after the copy of the rows.

    Full-precision tail (:attr:`tail`: ``tail`` given, else the backend's ``kv_tail``, else the format's
    ``full_precision_tail``; 0: off, and nothing below happens): :meth:`put` with ``layer`` and ``kind`` also
    keeps the K/V it is given, converted to ``dtype`` on its device, in a ring of that KPU's last ``tail``
    tokens written; :meth:`take` with ``layer`` and ``kind`` gives the tokens the ring holds (the newest
    ``min(tail, n)`` of a KPU's first ``n`` tokens once they were written in order) from the ring instead of
    their decoded rows, exactly as written. Tokens this object never wrote (a retained prefix) and rows put
    already encoded come from the rows. The rings take ``2 * layers * min(tail, max_tokens) * row_elems *
    dtype size`` bytes once every KPU was written (:meth:`tail_bytes`).

    On CUDA (``pin``) the slot pages are registered (pinned) so H2D/D2H copies are real DMA.
    """

    def __init__(self, backend: KVBackend, dtype: torch.dtype, pin: bool = False, *,
                 tail: int | None = None) -> None:
        g = backend.geometry
        self.geometry = g
        self.dtype = dtype
        #: the geometry's KV format (None: rows of ``dtype``'s own elements)
        self.format = stored_format(g)
        if tail is None:
            tail = getattr(backend, "kv_tail", None)
        #: the newest tokens of a KPU read back from this process's full-precision copy (0: none)
        self.tail = full_precision_tail(self.format, tail)
        self._ring_len = min(self.tail, g.max_tokens)
        #: per (layer, kind): the ring (``[ring_len, batch, kv_heads, head_dim]`` of ``dtype``, token ``p`` at
        #: ``p % ring_len``) and the tokens ``[lo, hi)`` it holds
        self._rings: dict[tuple[int, str], list[Any]] = {}
        #: the dtype of :attr:`views`; None for a quantized format (only :attr:`rows` then)
        self.view_dtype: torch.dtype | None = dtype if self.format is None else plain_dtype(self.format)
        self.views: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self._registered: list[int] = []
        for ch in range(backend.channels):
            mv = backend.slot(ch)
            raw = torch.frombuffer(mv, dtype=torch.uint8)[: g.kpu_bytes]
            self.rows.append(raw.view(g.max_tokens, g.token_bytes))
            if self.view_dtype is not None:
                self.views.append(raw.view(self.view_dtype).view(g.max_tokens, g.batch, g.kv_heads, g.head_dim))
            if pin and torch.cuda.is_available():
                from bladed.client import clear_cuda_error

                rc = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
                if int(rc) == 0:
                    self._registered.append(raw.data_ptr())
                else:  # the copies stay pageable; torch must not trip over the error the call left
                    clear_cuda_error()

    def put(self, ch: int, token_start: int, kv: torch.Tensor, *, layer: int | None = None,
            kind: str | None = None) -> None:
        """Put ``kv`` into the slot at ``token_start``, as the geometry's rows.

        ``kv``: the K or V of ``n`` tokens, heads-first ``[batch, kv_heads, n, head_dim]`` (any float dtype,
        any device), or rows already encoded in the session's format, uint8 ``[n, token_bytes]``. With
        ``layer`` and ``kind`` and a full-precision tail, the K/V also goes to that KPU's ring. Anything
        else is refused with a one-line ValueError naming the range (``layer``, ``kind``: for the message
        only) and the sizes, before the slot is touched.
        """
        fmt = self.format
        n = self._check(kv, token_start, layer, kind)
        if self._ring_len and layer is not None and kind is not None:
            self._keep_tail(layer, kind, token_start, kv)
        if kv.dtype == torch.uint8:              # encoded rows: bytes as they are
            self.rows[ch][token_start:token_start + n].copy_(kv)
        elif self.view_dtype is not None:        # no format, or a plain one: one (converting) copy
            self.views[ch][token_start:token_start + n].copy_(kv.permute(2, 0, 1, 3))
        else:
            assert fmt is not None
            rows = self.rows[ch][token_start:token_start + n]
            tokens_first = kv.permute(2, 0, 1, 3)
            if kv.device == rows.device:
                fmt.encode(tokens_first, out=rows)
            else:                                # quantize on the tensor's device, copy the rows
                rows.copy_(fmt.encode(tokens_first))

    def take(self, ch: int, ntokens: int, device: torch.device | str = "cpu",
             non_blocking: bool = False, token_start: int = 0, *, layer: int | None = None,
             kind: str | None = None, room: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """The K/V of the slot's tokens ``[token_start, token_start + ntokens)`` on ``device``, heads-first
        ``[batch, kv_heads, n, head_dim]`` of ``dtype`` (decoded from the format's rows if there is one).

        With ``layer`` and ``kind`` (the KPU the slot was read from) and a full-precision tail, the tokens
        that KPU's ring holds come from the ring instead (the values written, exactly).

        ``room``: the tensor has ``room`` more tokens after them, uninitialised (``[batch, kv_heads, n + room,
        head_dim]``), for the caller to write the step's new tokens into instead of concatenating (a copy of
        the whole past per layer and step).

        ``out``: a tokens-first ``[>= n + room, batch, kv_heads, head_dim]`` tensor of ``dtype`` on ``device``
        to put them in (a view of it is returned), instead of a new one: a caller that reuses its buffers
        spares the allocator fresh pages, which the kernel faults in and zeroes (on the CPU, a SmolLM2 decode
        step's loads are 0.5 GiB of them)."""
        g, fmt = self.geometry, self.format
        end = token_start + ntokens
        ring = self._rings.get((layer, str(kind))) if self._ring_len and layer is not None else None
        if out is not None:
            want = (g.batch, g.kv_heads, g.head_dim)
            if out.dtype != self.dtype or tuple(out.shape[1:]) != want or out.shape[0] < ntokens + room:
                raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, need {self.dtype} of at least "
                                 f"{(ntokens + room, *want)} (tokens first)")
            dst = out[:ntokens + room]
        else:
            dst = torch.empty((ntokens + room, g.batch, g.kv_heads, g.head_dim), dtype=self.dtype, device=device)
        if self.view_dtype is not None:
            # one copy; a plain format of other elements converts in it, back to the caller's dtype
            dst[:ntokens].copy_(self.views[ch][token_start:end], non_blocking=non_blocking)
            if ring is not None:
                self._apply_tail(ring, dst, token_start, ntokens)
            return dst.permute(1, 2, 0, 3)
        assert fmt is not None
        rows = self.rows[ch][token_start:end]
        if dst.device.type != "cpu":             # copy the rows (fewer bytes), dequantize on the device
            dev = torch.empty(rows.shape, dtype=torch.uint8, device=dst.device)
            dev.copy_(rows, non_blocking=non_blocking)
            rows = dev
        # decoded straight into the tensor with the room after it (on the CPU the C codec reads the slot's rows)
        x = dst
        fmt.decode(rows, out=x[:ntokens])
        if ring is not None:
            self._apply_tail(ring, x, token_start, ntokens)
        return x.permute(1, 2, 0, 3)

    def take_tokens(self, ch: int, index: torch.Tensor, device: torch.device | str = "cpu",
                    non_blocking: bool = False, *, layer: int | None = None, kind: str | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The slot's tokens ``index`` (a CPU long tensor, any order) tokens-first, ``[len(index), batch,
        kv_heads, head_dim]`` of ``dtype`` on ``device`` (into ``out[:len(index)]`` if given), decoded from the
        format's rows; with ``layer`` and ``kind``, the tokens that KPU's full-precision ring holds come from
        it, as :meth:`take` does for a range."""
        g, fmt = self.geometry, self.format
        m = int(index.numel())
        if out is None:
            out = torch.empty((m, g.batch, g.kv_heads, g.head_dim), dtype=self.dtype, device=device)
        dst = out[:m]
        if self.view_dtype is not None:
            picked = self.views[ch].index_select(0, index)
            dst.copy_(picked, non_blocking=non_blocking)
        else:
            assert fmt is not None
            rows = self.rows[ch].index_select(0, index)
            if dst.device.type != "cpu":
                rows = rows.to(dst.device, non_blocking=non_blocking)
            fmt.decode(rows, out=dst)
        ring = self._rings.get((layer, str(kind))) if self._ring_len and layer is not None else None
        if ring is not None:
            buf, lo, hi = ring
            inside = (index >= lo) & (index < hi)
            if bool(inside.any()):
                at = inside.nonzero().flatten()
                src = buf.index_select(0, (index[at] % self._ring_len).to(buf.device))
                dst.index_copy_(0, at.to(dst.device), src.to(dst.device))
        return dst

    def tail_bytes(self) -> int:
        """Bytes the full-precision rings hold now (``2 * layers * min(tail, max_tokens) * row_elems * dtype
        size`` once every KPU was written; 0 without a tail)."""
        return sum(int(r[0].numel()) * r[0].element_size() for r in self._rings.values())

    def _keep_tail(self, layer: int, kind: str, start: int, kv: torch.Tensor) -> None:
        """Keep the K/V of tokens ``[start, start + n)`` in the KPU's ring (encoded rows: drop what it held of
        them, their full-precision values are unknown)."""
        g, cap = self.geometry, self._ring_len
        n = int(kv.shape[0] if kv.dtype == torch.uint8 else kv.shape[2])
        end = start + n
        ring = self._rings.get((layer, kind))
        if kv.dtype == torch.uint8:
            if ring is not None and start < ring[2] and end > ring[1]:
                if start <= ring[1]:
                    ring[1] = min(end, ring[2])  # the tokens after the encoded ones stay
                else:
                    ring[2] = start              # the ring holds one run of tokens: those before them stay
            return
        if ring is None:
            buf = torch.empty((cap, g.batch, g.kv_heads, g.head_dim), dtype=self.dtype, device=kv.device)
            ring = self._rings[(layer, kind)] = [buf, 0, 0]
        lo, hi = ring[1], ring[2]
        if start <= hi and end >= lo and hi > lo:  # one run with what the ring holds
            lo, hi = min(lo, start), max(hi, end)
        else:
            lo, hi = start, end
        lo = max(lo, hi - cap)
        first = max(start, end - cap)            # only the last ``cap`` tokens of a long write are kept
        if first < end:
            src = kv[:, :, first - start:].permute(2, 0, 1, 3)
            buf = ring[0]
            a, b = first % cap, first % cap + (end - first)
            if b <= cap:
                buf[a:b].copy_(src)
            else:                                # wraps around the ring's end
                buf[a:].copy_(src[:cap - a])
                buf[:b - cap].copy_(src[cap - a:])
        ring[1], ring[2] = lo, hi

    def _apply_tail(self, ring: list[Any], x: torch.Tensor, token_start: int, ntokens: int) -> None:
        """Put the ring's tokens into ``x`` (tokens-first, tokens ``[token_start, token_start + ntokens)``) where
        they overlap it."""
        buf, lo, hi = ring
        cap = self._ring_len
        a, b = max(lo, token_start), min(hi, token_start + ntokens)
        if a >= b:
            return
        if buf.device != x.device:
            buf = buf.to(x.device)
        i, j = a % cap, a % cap + (b - a)
        dst = x[a - token_start:b - token_start]
        if j <= cap:
            dst.copy_(buf[i:j])
        else:
            dst[:cap - i].copy_(buf[i:])
            dst[cap - i:].copy_(buf[:j - cap])

    def _check(self, kv: torch.Tensor, token_start: int, layer: int | None, kind: str | None) -> int:
        """The tokens in ``kv`` once it fits the slot's rows at ``token_start``; ValueError naming the range."""
        g = self.geometry
        fmt = self.format.name if self.format is not None else str(self.dtype).removeprefix("torch.")
        rows = f"rows of batch x kv_heads x head_dim = {g.batch} x {g.kv_heads} x {g.head_dim} values " \
               f"({fmt}: {g.token_bytes} bytes a row)"
        encoded = kv.dtype == torch.uint8
        n = int(kv.shape[0] if encoded else kv.shape[2]) if kv.dim() == (2 if encoded else 4) else -1
        where = "KV" if layer is None else f"layer {layer} {str(kind).upper()}"
        span = f"tokens [{token_start}, {token_start + n})" if n >= 0 else f"tokens from {token_start}"
        if encoded:
            if kv.dim() != 2 or kv.shape[1] != g.token_bytes:
                size = f"rows of {kv.shape[1]} bytes" if kv.dim() == 2 else f"uint8 of shape {tuple(kv.shape)}"
                raise ValueError(f"{where} {span}: encoded {size}, the session stores {rows}; encode them with "
                                 f"bladed.kvformat.kv_format({fmt!r}) or pass the K/V tensor")
        elif not kv.is_floating_point() or kv.dim() != 4 or (kv.shape[0], kv.shape[1], kv.shape[3]) != (
                g.batch, g.kv_heads, g.head_dim):
            shape = f"{kv.dtype} of shape {tuple(kv.shape)}"
            raise ValueError(f"{where} {span}: {shape} is not [batch, kv_heads, tokens, head_dim] K/V of the "
                             f"session's {rows}")
        if token_start < 0 or token_start + n > g.max_tokens:
            raise ValueError(f"{where} {span}: outside the session's {g.max_tokens} tokens")
        return n

    def close(self) -> None:
        if self._registered and torch.cuda.is_available():
            from bladed.client import clear_cuda_error

            for ptr in self._registered:
                if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
                    clear_cuda_error()
        self._registered.clear()
        self.views.clear()
        self.rows.clear()
        self._rings.clear()


class PageReader:
    """Reads the pages a selection picked (``bladed.kvselect``) of one backend's KPUs, through its staging slots.

    :meth:`read` (a copy thread's read) reads the pages a step needs into the slot, at their own offsets: those
    the KPU's :class:`~bladed.kvselect.ReuseBuffer` lacks (``spec.reuse``), else all of them, as runs of
    consecutive pages (``read_runs``: one request per run on bladed), up to the step's tokens. :meth:`take` (its
    DMA, on the same thread) puts them in the buffer and gives the selected pages' tokens in page order,
    heads-first and decoded, with ``room`` after them for the step's new token. A page the full-precision
    tail holds (``SlotTensors.tail``) is read again while it does: the buffer keeps what was read, the tail
    may move on."""

    def __init__(self, backend: KVBackend, slots: SlotTensors, state: SelectionState) -> None:
        self.backend, self.slots, self.state = backend, slots, state
        g, spec = backend.geometry, state.spec
        self.page = spec.page
        self.max_pages = pages_of(g.max_tokens, spec.page)
        #: pages each reuse buffer holds: a step's selection, the union of every sequence's
        self.capacity = min(self.max_pages, g.batch * spec.pages_read(self.max_pages))
        self.buffers: dict[tuple[int, str], ReuseBuffer] = {}
        self._plans: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def read(self, layer: int, kind: Kind, ch: int, pages: torch.Tensor, ntokens: int) -> tuple[Any, int]:
        """Read what the step lacks of ``pages`` (sorted page ids of tokens ``[0, ntokens)``) into slot ``ch``:
        the backend's op and the pages read."""
        key = (layer, kind)
        dest = None
        miss = pages
        if self.state.spec.reuse:
            buf = self.buffers.get(key)
            if buf is None:
                buf = self.buffers[key] = ReuseBuffer(self.capacity, self.page, self.max_pages)
            fresh = max(0, ntokens - self.slots.tail) // self.page if self.slots.tail else self.max_pages
            miss, dest = buf.plan(pages, self.state.versions[layer], fresh_from=fresh,
                                  partial_from=ntokens // self.page)
        self._plans[key] = (miss, dest)
        p = self.page
        runs = [(first * p, min(count * p, ntokens - first * p)) for first, count in runs_of(miss)]
        read_runs = getattr(self.backend, "read_runs", None)
        if read_runs is not None:
            return read_runs(layer, kind, ch, runs), int(miss.numel())
        ops = [self.backend.read(layer, kind, ch, start, n) for start, n in runs]
        return KVOp(str(getattr(ops[0], "path", "?")) if ops else "?", sum(int(getattr(o, "nbytes", 0))
                                                                           for o in ops), 0, None), int(miss.numel())

    def take(self, layer: int, kind: Kind, ch: int, pages: torch.Tensor, ntokens: int,
             device: torch.device | str = "cpu", non_blocking: bool = False, *, room: int = 0,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """After :meth:`read` of the same pages: their tokens below ``ntokens`` in page order, heads-first
        ``[batch, kv_heads, n + room, head_dim]`` (``out``: a tokens-first buffer to put them in)."""
        g, p = self.geometry, self.page
        miss, dest = self._plans.pop((layer, kind))
        k = int(pages.numel())
        valid = k * p - max(0, (int(pages[-1]) + 1) * p - ntokens) if k else 0
        if out is None or out.shape[0] < k * p + room:
            out = torch.empty((k * p + room, g.batch, g.kv_heads, g.head_dim), dtype=self.slots.dtype,
                              device=device)
        last = g.max_tokens - 1
        if dest is None:
            self.slots.take_tokens(ch, token_index(pages, p).clamp_(max=last), device, non_blocking, layer=layer,
                                   kind=kind, out=out)
        else:
            buf = self.buffers[(layer, kind)]
            if miss.numel():
                rows = self.slots.take_tokens(ch, token_index(miss, p).clamp_(max=last), device, non_blocking,
                                              layer=layer, kind=kind)
                buf.fill(dest, rows)
            buf.gather(pages, out)
        return out[:valid + room].permute(1, 2, 0, 3)

    @property
    def geometry(self) -> Geometry:
        return self.backend.geometry

    def nbytes(self) -> int:
        """Bytes the reuse buffers hold."""
        return sum(b.nbytes() for b in self.buffers.values())

    def reuse(self) -> tuple[int, int]:
        """Pages served from the reuse buffers, and pages asked for, so far."""
        return sum(b.hits for b in self.buffers.values()), sum(b.lookups for b in self.buffers.values())


__all__ = [
    "PLAIN_FORMAT_DTYPES",
    "BladedKV",
    "Geometry",
    "KVBackend",
    "KVOp",
    "Kind",
    "MemoryKV",
    "PageReader",
    "PathStats",
    "SlotTensors",
    "StatsBook",
    "combined_op",
    "dtype_bytes",
    "full_precision_tail",
    "kv_geometry",
    "plain_dtype",
    "prefix_key_fields",
    "stored_format",
]
