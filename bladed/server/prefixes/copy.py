"""Copying KV between a session and a retained prefix, on a private channel (a ring and a slot of one KPU)
so that copies never pass through a client's memory.  Verifies and records block crcs; must not evict,
journal or count (``prefixes.cache`` does)."""

from __future__ import annotations

import logging

import numpy as np

from bladed.io import Engine, ExtentDevice, StagingBuffer
from bladed.protocol import IOOp, IORange, RequestError
from bladed.residency.geometry import Geometry
from bladed.server.prefixes.entry import RetainedPrefix, SessionKV, block_crcs
from bladed.server.storage import Access
from bladed.server.storage.channel import Channel
from bladed.sizes import PAGE_SIZE, align_up

log = logging.getLogger("bladed.prefix")


def copy_channel(device: ExtentDevice, queue_depth: int, read_window_bytes: int, geometry: Geometry) -> Channel:
    """A private ring and staging slot of one KPU of ``geometry``; what it writes counts as ``prefix``."""
    slot = StagingBuffer(align_up(geometry.kpu_bytes, max(PAGE_SIZE, device.lba_size)))
    try:
        ch = Channel(0, Engine(device, queue_depth, [slot]), slot, read_window_bytes)
    except BaseException:
        slot.close()
        raise
    ch.engine.label = "prefix"
    return ch


def write_blocks(sess: SessionKV, blocks: list[bytes], block_tokens: int, ch: Channel) -> int:
    """Write whole token blocks (each holding every KPU's rows, as the shared tier keeps them) into ``sess``,
    KPU by KPU; returns the tokens written."""
    B, tb, L = block_tokens, sess.geometry.token_bytes, sess.geometry.layers
    span = B * tb
    n = len(blocks) * B
    slot = ch.slot.view()
    try:
        for tid in range(2 * L):
            for b, payload in enumerate(blocks):
                slot[b * span:(b + 1) * span] = payload[tid * span:(tid + 1) * span]
            (r,) = sess.transfer(ch, [IORange(IOOp.WRITE, tid, 0, n, 0)])
            if r.error is not None:
                raise RequestError(r.error, f"copying the shared prefix into the session: {r.message}")
    finally:
        del slot
    return n


def copy_out(entry: RetainedPrefix, sess: SessionKV, blocks: int, ch: Channel) -> str | None:
    """Copy ``blocks`` whole blocks of every KPU from ``entry`` into ``sess``, each verified against its crcs
    first; None, or why the entry is bad (``io_error``, ``integrity_error``: it must be evicted)."""
    B = entry.rec.block_tokens
    n = blocks * B
    tb = sess.geometry.token_bytes
    for kpu in entry.plan.kpus:
        tid = kpu.tensor_id
        a = Access(IOOp.READ, kpu, 0, n, 0, n * tb, 0)
        entry.store_of(kpu).run(ch, [a])
        if a.result.error is not None:
            log.warning("retained prefix %s: %s; evicting it", entry.id, a.result.message)
            return "io_error"
        if not np.array_equal(block_crcs(ch.slot, blocks, B * tb), entry.crcs[tid, :blocks]):
            log.error("retained prefix %s: %s does not match its checksums; evicting it", entry.id, kpu.name)
            return "integrity_error"
        (r,) = sess.transfer(ch, [IORange(IOOp.WRITE, tid, 0, n, 0)])
        if r.error is not None:
            raise RequestError(r.error, f"copying the retained prefix into the session: {r.message}")
    return None


def copy_in(entry: RetainedPrefix, sess: SessionKV, ch: Channel, blocks_out: list[bytearray] | None = None) -> None:
    """Copy the session's first ``entry.tokens`` tokens of every KPU into the entry, recording the crcs (and
    gathering each block's rows of every KPU into ``blocks_out`` for the shared tier)."""
    B = entry.rec.block_tokens
    n = entry.tokens
    tb = sess.geometry.token_bytes
    for kpu in entry.plan.kpus:
        tid = kpu.tensor_id
        (r,) = sess.transfer(ch, [IORange(IOOp.READ, tid, 0, n, 0)])
        if r.error is not None:
            raise RequestError(r.error, f"reading the session's KV to retain it: {r.message}")
        entry.crcs[tid] = block_crcs(ch.slot, n // B, B * tb)
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


__all__ = ["copy_channel", "copy_in", "copy_out", "write_blocks"]
