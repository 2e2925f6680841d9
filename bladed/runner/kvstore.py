"""Where the runner's offloaded KV cache lives: the ``KVBackend`` protocol.

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
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from bladed.residency.geometry import Geometry

Kind = Literal["k", "v"]

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a KV dtype (ValueError naming the supported ones for any other)."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in _DTYPE_BYTES)
        raise ValueError(f"KV dtype {dtype} is not supported; use one of {known}") from None


@dataclass
class KVOp:
    """What one read or write did (the client's ``OpResult`` has the same fields)."""

    path: str
    nbytes: int
    service_ns: int
    hit_ratio: float | None = None


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
    """The reference backend: every KPU is a buffer in this process."""

    def __init__(self, geometry: Geometry, channels: int = 2, groups: dict[int, int] | None = None) -> None:
        self.geometry = geometry
        self._channels = channels
        self._slots = [bytearray(geometry.kpu_bytes) for _ in range(channels)]
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

    def close(self) -> None:
        self._store.clear()


class BladedKV:
    """A ``bladed.client`` session as a KV backend.

    ``session`` is an open ``Session``; ``geometry`` must be the one it was
    opened with. Use :meth:`open` to open the session from a client.
    """

    def __init__(self, session: Any, geometry: Geometry, owns_client: Any = None) -> None:
        self.session = session
        self.geometry = geometry
        self._client = owns_client
        self._groups: dict[tuple[int, str], int] = {}
        plan = getattr(session, "plan", None) or {}
        for kpu in plan.get("kpus", []) if isinstance(plan, dict) else []:
            try:
                self._groups[(int(kpu["layer"]), str(kpu["kind"]))] = int(kpu["group"])
            except (KeyError, TypeError, ValueError):
                continue
        self._nslots = int(getattr(session, "channels", 0) or 0)

    @classmethod
    def open(cls, geometry: Geometry, mode: str = "dualblade", channels: int = 2,
             socket_path: str | None = None, client: Any = None) -> BladedKV:
        from bladed import client as bclient  # floor 2: only the client library

        own = None
        if client is None:
            client = own = bclient.Client(socket_path=socket_path)
        sess = client.open_session(geometry, mode=mode, channels=channels)
        kv = cls(sess, geometry, owns_client=own)
        kv._nslots = channels
        return kv

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
        return self.session.write(layer, kind, ch, token_start=token_start, ntokens=ntokens)

    def read(self, layer: int, kind: Kind, ch: int, token_start: int = 0,
             ntokens: int | None = None) -> Any:
        return self.session.read(layer, kind, ch, token_start=token_start, ntokens=ntokens)

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            if self._client is not None:
                self._client.close()
                self._client = None


class SlotTensors:
    """Torch views over a backend's staging slots, KPU-shaped: ``[max_tokens, batch, kv_heads, head_dim]``.

    On CUDA the slot pages are registered (pinned) so H2D/D2H copies are real DMA.
    """

    def __init__(self, backend: KVBackend, dtype: torch.dtype, pin: bool = False) -> None:
        g = backend.geometry
        self.geometry = g
        self.views: list[torch.Tensor] = []
        self._registered: list[int] = []
        for ch in range(backend.channels):
            mv = backend.slot(ch)
            raw = torch.frombuffer(mv, dtype=torch.uint8)[: g.kpu_bytes]
            t = raw.view(dtype).view(g.max_tokens, g.batch, g.kv_heads, g.head_dim)
            if pin and torch.cuda.is_available():
                rc = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
                if int(rc) == 0:
                    self._registered.append(raw.data_ptr())
            self.views.append(t)

    def put(self, ch: int, token_start: int, kv: torch.Tensor) -> None:
        """Copy ``kv`` (``[batch, kv_heads, n, head_dim]``) into the slot at ``token_start``."""
        n = kv.shape[2]
        self.views[ch][token_start:token_start + n].copy_(kv.permute(2, 0, 1, 3))

    def take(self, ch: int, ntokens: int, device: torch.device | str = "cpu",
             non_blocking: bool = False) -> torch.Tensor:
        """A device copy of the slot's first ``ntokens`` tokens, heads-first ``[batch, kv_heads, n, d]``."""
        src = self.views[ch][:ntokens]
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
        dst.copy_(src, non_blocking=non_blocking)
        return dst.permute(1, 2, 0, 3)

    def close(self) -> None:
        if self._registered and torch.cuda.is_available():
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        self.views.clear()


__all__ = [
    "BladedKV",
    "Geometry",
    "KVBackend",
    "KVOp",
    "Kind",
    "MemoryKV",
    "PathStats",
    "SlotTensors",
    "StatsBook",
    "dtype_bytes",
]
