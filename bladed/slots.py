"""Torch views over a KV backend's staging slots (``bladed.kvstore``), and what reads K/V through them.

``SlotTensors`` gives the K/V tensors a slot holds, so copy threads move K/V between torch tensors and a slot
with one ``copy_``; it encodes K/V into the slot's rows of a KV format (``bladed.kvformat``) and decodes them
back into the caller's dtype, in this process and on the tensor's device, and keeps the full-precision tail.

Full-precision tail (``KVFormat.full_precision_tail``: 128 for ``q4``, 0 for the others): ``SlotTensors``
keeps, per layer and K/V, a ring of the last ``tail`` tokens it wrote, in the caller's dtype on the tensor's
device, and a read of a KPU's tokens gives the newest ``min(tail, n)`` of them from that ring instead of
their decoded rows (the rows are written all the same); what ``tools/bench_kv_accuracy.py`` measured. It
costs ``2 * layers * tail * row_elems * dtype size`` of memory per ``SlotTensors``. ``kv_tail`` (of
``SlotTensors``, ``MemoryKV``, ``BladedKV``) overrides the format's, 0 turns it off.

``PageReader`` reads the pages a sparse decode step selected (``bladed.kvselect``) through the slots, with
the reuse buffers that keep a layer's pages from one step to the next.
"""

from __future__ import annotations

from typing import Any

import torch

from bladed import cuda
from bladed.kvselect import ReuseBuffer, SelectionState, pages_of, runs_of, token_index
from bladed.kvstore import Kind, KVBackend, KVOp, full_precision_tail, plain_dtype, stored_format
from bladed.residency.geometry import Geometry


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
            # a refusal leaves the copies pageable (the error cleared: torch must not trip over it)
            if pin and torch.cuda.is_available() and cuda.host_register(raw.data_ptr(), raw.numel()) == 0:
                self._registered.append(raw.data_ptr())

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
            for ptr in self._registered:
                cuda.host_unregister(ptr)
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


__all__ = ["PageReader", "SlotTensors"]
