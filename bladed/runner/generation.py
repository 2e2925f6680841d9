"""The FlexLLMGen-style generation loop over the zig-zag (token, layer, GPU batch) schedule.

:meth:`Runner.generate` has the shape of FlexLLMGen's ``generation_loop_normal``: for every
generation step it walks the layers and, inside a layer, the GPU batches, and calls named steps
of :class:`_Generation` (the state of one ``generate`` call) in FlexLLMGen's order:
``load_weight``, ``load_cache``, ``load_hidden``, ``compute_layer``, ``store_hidden``,
``store_cache``; a step ends with ``sample_tokens`` (the LM head's greedy tokens) and ``sync``.

A layer's KV cache lives on one of three tiers chosen by the policy's cache percentages: the
compute device ("gpu"), host memory ("cpu"), or offloaded to a ``KVBackend`` ("disk": bladed).
Offloaded KV moves through the copy threads: prefill writes every offloaded layer's K and V
(tokens ``[0, prompt_len)``); each decode step reads tokens ``[0, pos)`` and appends the new
token's K/V at ``pos`` (Algorithm 2 offsets: ``token_start * token_bytes``). With ``overlap``
the load of the next offloaded (layer, batch) is issued before the current one computes
(``prefetch_cache``, layer-ahead prefetch) and writes are not waited for.

Prefix reuse: a backend opened with a prefix key may start with the KV of the prompt's first
``prefix_tokens`` tokens already in it (a retained prefix, copied in by bladed). The prefill then
computes only tokens ``[prefix_tokens, prompt_len)`` at their own positions (rotary offsets, OPT's
learned positions), attending to the prefix's KV read back like a decode step's past; at least the
prompt's last token is computed, for the logits. ``generate(retain_prefix=True)`` ends by keeping
the KV the run wrote (the prompt and every generated token fed back) as a retained prefix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from bladed.kvformat import kv_format as parse_kv_format
from bladed.kvselect import SelectionState, SelectSpec, pages_of, parse_select
from bladed.kvstore import (
    Geometry,
    Kind,
    KVBackend,
    StatsBook,
    full_precision_tail,
    kv_geometry,
)
from bladed.pipeline import AdaptivePipeline, CopyThreadPool, LoadHandle, LoadJob, PipelineMode, TorchDma
from bladed.runner.models import DecoderModel, attention
from bladed.slots import PageReader, SlotTensors

KVFactory = Callable[[Geometry], KVBackend]
KVPair = tuple[torch.Tensor, torch.Tensor]  # (keys, values), heads-first: [batch, kv_heads, tokens, head_dim]


@dataclass
class Policy:
    """FlexLLMGen's policy: batch shape, the six placement percentages, overlap.

    Percentages are of layers: the first ``cache_gpu_percent`` of the layers keep
    their KV on the compute device, the next ``cache_cpu_percent`` in host memory,
    the rest is offloaded to bladed. Weights and activations: the ``gpu`` share
    stays on the compute device, the rest is kept in host memory and moved per
    use (the same memory on a CPU-only host).

    ``kv_format`` is how the offloaded KV is stored (``bladed.kvformat``, FlexLLMGen's
    ``compress_cache`` generalised): ``""`` rows of the model's dtype, as always; ``fp16``,
    ``bf16``, ``fp32`` rows of those elements; ``q8``, ``q4`` quantized rows. The copy threads
    encode the K/V into the staging slot and decode it back on the compute device; the KV kept
    on the device or in host memory is not affected.

    ``prefetch``: with ``overlap``, how many offloaded (layer, GPU batch) loads run ahead of the one computing
    (FlexLLMGen: 1, the next layer's).

    ``kv_tail``: the newest tokens of each offloaded (layer, K/V) read back from a full-precision copy
    kept on the compute device instead of their decoded rows (``bladed.slots.SlotTensors``; the rows are
    written all the same). None: the format's ``full_precision_tail`` (``q4``: 128, the others 0); 0: off.

    ``kv_select``: query-aware sparse decode reads of the offloaded layers (``bladed.kvselect``, the runner's
    ``--kv-select``: ``keys:0.25``, ...): a decode step reads only the pages its selection picks. None: every
    step reads all of its past, as always.
    """

    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100.0
    w_cpu_percent: float = 0.0
    cache_gpu_percent: float = 0.0
    cache_cpu_percent: float = 0.0
    act_gpu_percent: float = 100.0
    act_cpu_percent: float = 0.0
    overlap: bool = True
    pipeline: PipelineMode = "adaptive"
    copy_threads: int = 2
    kv_format: str = ""
    kv_tail: int | None = None
    prefetch: int = 1
    kv_select: str | SelectSpec | None = None

    @property
    def percent(self) -> list[float]:
        return [self.w_gpu_percent, self.w_cpu_percent, self.cache_gpu_percent, self.cache_cpu_percent,
                self.act_gpu_percent, self.act_cpu_percent]

    def cache_tiers(self, num_layers: int) -> list[str]:
        n_gpu = round(num_layers * self.cache_gpu_percent / 100)
        n_cpu = min(num_layers - n_gpu, round(num_layers * self.cache_cpu_percent / 100))
        return ["gpu"] * n_gpu + ["cpu"] * n_cpu + ["disk"] * (num_layers - n_gpu - n_cpu)

    def weight_tiers(self, num_layers: int) -> list[str]:
        n_gpu = round(num_layers * self.w_gpu_percent / 100)
        return ["gpu"] * n_gpu + ["cpu"] * (num_layers - n_gpu)


@dataclass
class GenerationResult:
    tokens: torch.Tensor                     # [batch, gen_len]
    logits: list[torch.Tensor]               # gen_len x [batch, vocab], float32
    prefill_latency: float
    decode_latency: float
    step_latencies: list[float]
    prompt_len: int
    batch: int
    stats: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)
    tiers: list[str] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)
    load_wait_s: float = 0.0
    #: leading prompt tokens whose KV came from a retained prefix: the prefill computed the rest
    prefix_tokens: int = 0
    #: seconds to open the KV backends (with prefix reuse: the lookup and the copy of the prefix's KV)
    open_latency: float = 0.0
    #: per KV backend, what ``retain_prefix`` kept (the backend's reply), in GPU batch order
    retained: list[dict[str, Any]] = field(default_factory=list)
    #: per step (the prefill first): where its time went (:class:`StepTimes`, :data:`STEP_FIELDS`)
    step_times: list[dict[str, float]] = field(default_factory=list)
    #: with ``kv_select``: the spec, the bytes held for it and what it read (:meth:`_Generation.select_report`)
    select: dict[str, Any] = field(default_factory=dict)

    @property
    def gen_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def total_latency(self) -> float:
        return self.prefill_latency + self.decode_latency

    @property
    def ttft(self) -> float:
        """Time to first token: opening the KV backends (finding and copying a prefix) plus the prefill step."""
        return self.open_latency + self.prefill_latency

    def throughputs(self) -> dict[str, float]:
        b = self.batch
        dec_tokens = b * max(0, self.gen_len - 1)
        computed = self.prompt_len - self.prefix_tokens  # the prefill's own tokens
        return {
            "ttft_s": self.ttft,
            "prefill_latency_s": self.prefill_latency,
            "prefill_throughput_tok_s": b * computed / self.prefill_latency if self.prefill_latency else 0.0,
            "decode_latency_s": self.decode_latency,
            "decode_throughput_tok_s": dec_tokens / self.decode_latency if self.decode_latency else 0.0,
            "total_latency_s": self.total_latency,
            "total_throughput_tok_s": b * self.gen_len / self.total_latency if self.total_latency else 0.0,
        }


#: what :class:`StepTimes` adds up per step: seconds of the compute thread (``compute_s``: the layers and the
#: head; ``load_wait_s``: waiting for a layer's KV; ``select_s``: with ``kv_select``, scoring and choosing the
#: pages and keeping the selector's copy of K) and busy seconds of the copy threads (``read_s``: the KV
#: backend's reads into the staging slots; ``dma_s``: slot to device, decoded; ``write_s``: into the slot,
#: encoded, then the backend's write), with the bytes read and written; with ``kv_select`` also the pages the
#: selecting layers attended to (``pages_selected``) of those their past holds (``pages_total``), the pages
#: read (``pages_read``) and those the reuse buffers served (``reuse_hits``)
STEP_FIELDS = ("wall_s", "compute_s", "load_wait_s", "select_s", "read_s", "dma_s", "write_s", "read_bytes",
               "write_bytes", "pages_selected", "pages_total", "pages_read", "reuse_hits")


class StepTimes:
    """Where each generation step's time went (:data:`STEP_FIELDS`), added to by the compute thread and the
    copy threads. A copy thread's work counts for the step that issued it (a write left in flight at a step's
    end counts for that step). On CUDA ``compute_s`` and ``dma_s`` are host seconds: the kernels and copies
    run asynchronously, ``load_wait_s`` and the step's wall time include what the host waited for."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            self.steps.append(dict.fromkeys(STEP_FIELDS, 0.0))

    def add(self, step: int, field: str, value: float) -> None:
        with self._lock:
            self.steps[step][field] += value

    def as_list(self) -> list[dict[str, float]]:
        with self._lock:
            return [{"step": i, **{k: round(v, 6) if k.endswith("_s") else int(v) for k, v in rec.items()}}
                    for i, rec in enumerate(self.steps)]


class Runner:
    """Runs a :class:`DecoderModel` with its KV cache placed by a :class:`Policy`."""

    def __init__(self, model: DecoderModel, policy: Policy | None = None, kv_factory: KVFactory | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.policy = policy or Policy()
        self.kv_factory = kv_factory
        self.device = torch.device(device)
        cfg = model.cfg
        self.tiers = self.policy.cache_tiers(cfg.num_layers)
        if "disk" in self.tiers and kv_factory is None:
            raise ValueError("the policy offloads KV but no KV backend factory was given")
        if self.policy.kv_format:                # KVFormatError naming the format and the head_dim
            parse_kv_format(self.policy.kv_format).check(cfg.head_dim)
        #: the full-precision tail of the offloaded KV (ValueError, one line, for a negative kv_tail)
        self.kv_tail = full_precision_tail(self.policy.kv_format, self.policy.kv_tail)
        #: the sparse decode reads (None: dense); a bad spec is a SelectError (ValueError), one line
        self.select = parse_select(self.policy.kv_select) if self.policy.kv_select else None
        if self.select is not None:
            self.select.check_layers(cfg.num_layers)
        weight_tiers = self.policy.weight_tiers(cfg.num_layers)
        # a layer's weights stay on the compute device, or in (pinned) host memory and are copied per use
        self._device_weights: dict[int, dict[str, torch.Tensor]] = {}
        self._host_weights: dict[int, dict[str, torch.Tensor]] = {}
        for layer in range(cfg.num_layers):
            weights = model.layer_weights(layer)
            if weight_tiers[layer] == "gpu" or self.device.type == "cpu":
                self._device_weights[layer] = {name: w.to(self.device) for name, w in weights.items()}
            else:
                self._host_weights[layer] = {name: w.pin_memory() if torch.cuda.is_available() else w
                                             for name, w in weights.items()}
        if self.device.type != "cpu":
            self.model = model.to(self.device)
        self.offload_activations = self.device.type == "cuda" and self.policy.act_gpu_percent < 100

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, gen_len: int, eos_token_id: int | None = None,
                 on_step: Callable[[int, float], None] | None = None, *,
                 retain_prefix: bool = False) -> GenerationResult:
        """Greedy generation of up to ``gen_len`` tokens (fewer when every sequence produced ``eos_token_id``).

        ``on_step(tokens_done, step_seconds)`` is called after each step (the first is the prefill).
        A KV backend that starts with a retained prefix (its ``prefix_tokens``) spares the prefill those
        tokens. ``retain_prefix``: at the end each backend with a ``retain`` method (one sequence per GPU
        batch) keeps the KV written (the prompt and the generated tokens fed back) and closes with it.
        """
        prompt_len = self._check_request(input_ids, gen_len)
        if retain_prefix and self.policy.gpu_batch_size != 1:
            raise ValueError(f"retain_prefix keeps one sequence per KV backend; gpu_batch_size is "
                             f"{self.policy.gpu_batch_size}, use 1")
        gen = _Generation(self, prompt_len, gen_len)
        try:
            opened = time.perf_counter()
            gen.open_kv_backends()
            gen.open_latency = time.perf_counter() - opened
            gen.start = gen.reused_prefix()
            gen.set_prompt(input_ids)
            for step in range(gen_len):
                gen.begin_step(step)
                for layer in range(self.model.cfg.num_layers):
                    for gpu_batch in range(self.policy.num_gpu_batches):
                        weights = gen.load_weight(layer)
                        if gen.sparse(layer, gpu_batch):  # the pages its query selects, read on demand
                            hidden, new_kv = gen.sparse_layer(layer, gpu_batch, weights, gen.load_hidden(gpu_batch))
                            gen.store_hidden(gpu_batch, hidden)
                            gen.store_cache(layer, gpu_batch, new_kv, new_kv)
                            continue
                        past = gen.load_cache(layer, gpu_batch)
                        if self.policy.overlap:
                            gen.prefetch_cache(layer, gpu_batch)
                        hidden = gen.load_hidden(gpu_batch)
                        hidden, new_kv, full_kv = gen.timed_compute(weights, hidden, past)
                        gen.store_hidden(gpu_batch, hidden)
                        gen.store_cache(layer, gpu_batch, new_kv, full_kv)
                        gen.release(past)
                tokens = gen.timed(gen.sample_tokens)
                step_seconds = gen.sync()
                if on_step is not None:
                    on_step(step + 1, step_seconds)
                if gen.all_finished(tokens, eos_token_id):
                    break
            gen.wait_for_writes()
            if retain_prefix:
                gen.retain_kv()
            return gen.result()
        finally:
            gen.close()

    def _check_request(self, input_ids: torch.Tensor, gen_len: int) -> int:
        """The prompt length, once the batch matches the policy and prompt plus ``gen_len`` fits the model."""
        cfg = self.model.cfg
        batches, batch_size = self.policy.num_gpu_batches, self.policy.gpu_batch_size
        if input_ids.shape[0] != batches * batch_size:
            raise ValueError(f"a batch of {input_ids.shape[0]} prompts does not match gpu_batch_size * "
                             f"num_gpu_batches = {batch_size} * {batches}; pass {batches * batch_size} prompts "
                             f"or change the policy")
        if gen_len < 1:
            raise ValueError(f"gen_len {gen_len} must be at least 1")
        prompt_len = int(input_ids.shape[1])
        positions = prompt_len + gen_len - 1  # the last generated token is never fed back
        if positions > cfg.max_positions:
            raise ValueError(f"a {prompt_len}-token prompt plus gen_len {gen_len} needs {positions} positions, "
                             f"more than {cfg.name}'s {cfg.max_positions}; shorten the prompt or gen_len")
        if self.select is not None:
            self.select.check_context(prompt_len + gen_len, cfg.num_layers)
        return prompt_len


class _Generation:
    """One :meth:`Runner.generate` call: its state and the named steps its loop calls.

    Holds the copy threads, the adaptive pipeline, one KV backend per GPU batch (with torch views
    over its staging slots), the KV of the layers kept on the device or in host memory, and the
    current step's hidden states. Copy thread 0 carries K and thread 1 V (the one thread with
    ``copy_threads=1``): each owns the staging slot of its index in every backend.
    """

    def __init__(self, runner: Runner, prompt_len: int, gen_len: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.policy = policy = runner.policy
        self.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.tiers = runner.tiers
        self.prompt_len = prompt_len
        self.max_tokens = prompt_len + gen_len
        offloaded_layers = [layer for layer, tier in enumerate(self.tiers) if tier == "disk"]
        #: a model layer's index among the backends' layers (the offloaded layers only)
        self.backend_layer = {layer: index for index, layer in enumerate(offloaded_layers)}
        #: the offloaded (layer, GPU batch) pairs in schedule order: what prefetch_cache looks ahead in
        self.offloaded_order = [(layer, b) for layer in offloaded_layers for b in range(policy.num_gpu_batches)]
        self.channel: dict[Kind, int] = {"k": 0, "v": 1 % policy.copy_threads}  # copy thread = staging slot
        self.copy_threads = CopyThreadPool(policy.copy_threads)
        try:
            self.pipeline = AdaptivePipeline(self.copy_threads, policy.pipeline)
        except BaseException:
            self.copy_threads.close()           # a refused pipeline mode leaves no threads behind
            raise
        self.dma = TorchDma(self.device)
        self.stats = StatsBook()
        self.backends: list[KVBackend] = []
        self.slots: list[SlotTensors] = []
        self.writes: list[Future[Any]] = []
        self.resident_kv: dict[tuple[int, int], KVPair] = {}  # (layer, GPU batch) -> KV on the device or host
        self.load_wait_s = 0.0
        self.times = StepTimes()
        self.open_latency = 0.0
        self.start = 0                    # the prefill's first position: tokens before it came from a prefix
        self.retained: list[dict[str, Any]] = []
        self.prompt_ids = torch.empty(0, dtype=torch.long)
        self.step = 0
        self.position = 0                 # the position of the step's first input token
        self.step_tokens = 0              # the tokens the step computes per sequence
        self.inputs: list[torch.Tensor] = []   # per GPU batch: the token ids the step feeds in
        self.hidden: list[torch.Tensor] = []   # per GPU batch: the hidden states between layers
        self.prefetched: dict[tuple[int, int], LoadHandle] = {}  # loads issued ahead (at most policy.prefetch)
        #: on the CPU, the tokens-first buffers that loads put K/V in, reused from layer to layer: a new tensor
        #: per load is fresh pages the kernel faults in and zeroes (0.5 GiB a step for SmolLM2 at batch 12)
        self._free_buffers: list[torch.Tensor] = []
        self._lent_buffers: dict[int, torch.Tensor] = {}    # by storage address
        self._buffers_lock = threading.Lock()
        self.step_started = 0.0
        self.step_latencies: list[float] = []
        self.out_tokens: list[torch.Tensor] = []
        self.out_logits: list[torch.Tensor] = []
        self.finished = torch.zeros(policy.num_gpu_batches * policy.gpu_batch_size, dtype=torch.bool)
        #: with kv_select: per GPU batch the selector's state and the reader of the selected pages
        self.select = runner.select
        self.select_states: list[SelectionState] = []
        self.page_readers: list[PageReader] = []
        #: whether this step's decode reads a selection (the past holds more pages than the budget)
        self.sparse_step = False

    # -- set-up and tear-down --------------------------------------------
    def open_kv_backends(self) -> None:
        """Open one KV backend per GPU batch (when any layer is offloaded) and map its staging slots."""
        if not self.offloaded_order:
            return
        policy, cfg, dtype = self.policy, self.model.cfg, self.model.dtype
        assert self.runner.kv_factory is not None
        geometry = kv_geometry(layers=len(self.backend_layer), batch=policy.gpu_batch_size, kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, max_tokens=self.max_tokens, dtype=dtype,
                               kv_format=policy.kv_format)
        for _ in range(policy.num_gpu_batches):
            backend = self.runner.kv_factory(geometry)
            self.backends.append(backend)        # closed by close() even if it is refused below
            need = min(2, policy.copy_threads)   # K goes through slot 0, V through slot 1
            if backend.channels < need:
                raise ValueError(f"the KV backend has {backend.channels} staging slots, need {need}; open it with "
                                 f"channels >= {need}")
            # the same tail whatever the backend: memory and bladed runs of one format give the same bits
            self.slots.append(SlotTensors(backend, dtype, pin=self.cuda and not getattr(backend, "prepinned", False),
                                          tail=self.runner.kv_tail))
            if self.select is not None:
                selecting = [bl for layer, bl in self.backend_layer.items() if self.select.layer_selects(layer)]
                state = SelectionState(self.select, geometry.layers, geometry.max_tokens, self.model.attention_scale,
                                       selecting)
                self.select_states.append(state)
                self.page_readers.append(PageReader(backend, self.slots[-1], state))

    def reused_prefix(self) -> int:
        """The leading prompt tokens whose KV every backend already holds (a retained prefix), at most all
        but the last (whose logits the first token needs). 0 when a layer's KV is kept on the device or in
        host memory: only offloaded layers come with a prefix, so every token is computed again."""
        if not self.backends or any(tier != "disk" for tier in self.tiers):
            return 0
        reused = min(int(getattr(backend, "prefix_tokens", 0) or 0) for backend in self.backends)
        return min(reused, self.prompt_len - 1)

    def set_prompt(self, input_ids: torch.Tensor) -> None:
        """Split the prompts into the GPU batches, on the compute device: the prefill's inputs (from ``start``)."""
        size = self.policy.gpu_batch_size
        self.prompt_ids = input_ids.cpu()
        self.inputs = [input_ids[b * size:(b + 1) * size, self.start:].to(self.device)
                       for b in range(self.policy.num_gpu_batches)]

    def close(self) -> None:
        """Stop the copy threads (after their queued jobs), unmap the staging slots, close the backends."""
        self.copy_threads.close()
        for slots in self.slots:
            slots.close()
        for backend in self.backends:
            backend.close()

    # -- one generation step ---------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start step ``step`` (0 = prefill): its clock, the pipeline's iteration, the embedded inputs."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.step_started = time.perf_counter()
        self.pipeline.begin_iteration(step)
        self.times.begin()
        self.step = step
        self.position = self.start if step == 0 else self.prompt_len + step - 1
        #: the tokens this step computes per sequence (the prefill's from ``start``, then one)
        self.step_tokens = self.prompt_len - self.start if step == 0 else 1
        self.hidden = [self.model.embed(ids, self.position) for ids in self.inputs]
        self.prefetched = {}
        self.sparse_step = self.select is not None and step > 0 and not self.select.is_dense(self.position)

    def load_weight(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's weights on the compute device (copied from host memory when kept there)."""
        weights = self.runner._device_weights.get(layer)
        if weights is not None:
            return weights
        return {name: w.to(self.device, non_blocking=True) for name, w in self.runner._host_weights[layer].items()}

    def load_cache(self, layer: int, gpu_batch: int) -> KVPair | None:
        """The KV of tokens ``[0, position)`` of (layer, GPU batch) on the compute device; None at a prefill
        from token 0 (a prefill after a reused prefix reads the prefix's KV).

        Offloaded: the load prefetched for it, or one issued now, waited for (the wait counts in
        ``load_wait_s``). Kept on the device or in host memory: those tensors, moved to the device.
        """
        if self.position == 0:
            return None
        if self.tiers[layer] != "disk":
            keys, values = self.resident_kv[(layer, gpu_batch)]
            return keys.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True)
        handle = self.prefetched.pop((layer, gpu_batch), None) or self._submit_load(layer, gpu_batch)
        wait_started = time.perf_counter()
        keys, values = handle.result()
        waited = time.perf_counter() - wait_started
        self.load_wait_s += waited
        self.times.add(self.step, "load_wait_s", waited)
        if self.select_states:                   # K this process never wrote (a reused prefix): summarise it
            state, bl = self.select_states[gpu_batch], self.backend_layer[layer]
            if bl in state.selecting and not state.ready(bl, self.position):
                started = time.perf_counter()
                state.on_read(bl, keys[:, :, :self.position].permute(2, 0, 1, 3))
                self.times.add(self.step, "select_s", time.perf_counter() - started)
        return keys, values

    def prefetch_cache(self, layer: int, gpu_batch: int) -> None:
        """With ``overlap``: issue the loads of the next ``prefetch`` offloaded (layer, GPU batch) pairs after
        this one that are not issued yet.

        Called once this one's KV is loaded and before it computes; none at a prefill from token 0 (no KV
        to read). The copy threads run the loads in order, so a deeper prefetch keeps the storage busy
        through layers whose loads are quick (page-cache layers), and holds ``prefetch`` layers' K/V more
        in memory (each a ``[batch, kv_heads, tokens, head_dim]`` tensor on the device per K and V).
        """
        if self.position == 0:
            return
        ahead = [pair for pair in self.offloaded_order
                 if pair > (layer, gpu_batch) and not self.sparse(*pair)][:self.policy.prefetch]
        for pair in ahead:
            if pair not in self.prefetched:
                self.prefetched[pair] = self._submit_load(*pair)

    def load_hidden(self, gpu_batch: int) -> torch.Tensor:
        """The GPU batch's hidden states on the compute device (copied back when activations are offloaded)."""
        hidden = self.hidden[gpu_batch]
        return hidden.to(self.device, non_blocking=True) if self.runner.offload_activations else hidden

    def _borrow_buffer(self, geometry: Geometry) -> torch.Tensor | None:
        """A free load buffer (``[max_tokens, batch, kv_heads, head_dim]``), or a new one; None off the CPU (the
        device's caching allocator reuses its memory by itself)."""
        if self.device.type != "cpu":
            return None
        with self._buffers_lock:
            buf = self._free_buffers.pop() if self._free_buffers else None
        if buf is None:
            g = geometry
            buf = torch.empty((g.max_tokens, g.batch, g.kv_heads, g.head_dim), dtype=self.model.dtype)
        with self._buffers_lock:
            self._lent_buffers[buf.untyped_storage().data_ptr()] = buf
        return buf

    def release(self, past: KVPair | None) -> None:
        """A layer is done with its loaded K/V: their buffers go back to the free list."""
        if past is None or not self._lent_buffers:
            return
        with self._buffers_lock:
            for t in past:
                buf = self._lent_buffers.pop(t.untyped_storage().data_ptr(), None)
                if buf is not None:
                    self._free_buffers.append(buf)

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the compute thread, its seconds counted as the step's compute."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.times.add(self.step, "compute_s", time.perf_counter() - started)

    def timed_compute(self, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                      past: KVPair | None) -> tuple[torch.Tensor, KVPair, KVPair]:
        """:meth:`compute_layer`, timed as the step's compute."""
        out: tuple[torch.Tensor, KVPair, KVPair] = self.timed(self.compute_layer, weights, hidden, past)
        return out

    def compute_layer(self, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                      past: KVPair | None) -> tuple[torch.Tensor, KVPair, KVPair]:
        """One decoder layer over the step's tokens: (hidden out, the step's new KV, past + new KV)."""
        hidden, query, new_keys, new_values = self.model.qkv(weights, hidden, self.position)
        if past is None:
            keys, values = new_keys, new_values
        elif past[0].shape[2] > self.position:   # a load's tensors, with room for the step's tokens
            past[0][:, :, self.position:].copy_(new_keys)
            past[1][:, :, self.position:].copy_(new_values)
            keys, values = past
        else:
            keys, values = torch.cat([past[0], new_keys], dim=-2), torch.cat([past[1], new_values], dim=-2)
        hidden = self.model.attend_mlp(weights, hidden, query, keys, values)
        return hidden, (new_keys, new_values), (keys, values)

    def sparse(self, layer: int, gpu_batch: int) -> bool:
        """Whether (layer, GPU batch) reads a selection this step: an offloaded layer past the dense ones, at a
        decode step whose past holds more pages than the budget, with its selector up to date."""
        return (self.sparse_step and self.tiers[layer] == "disk" and self.select is not None
                and self.select.layer_selects(layer)
                and self.select_states[gpu_batch].ready(self.backend_layer[layer], self.position))

    def sparse_layer(self, layer: int, gpu_batch: int, weights: dict[str, torch.Tensor],
                     hidden: torch.Tensor) -> tuple[torch.Tensor, KVPair]:
        """One decoder layer of a decode step through the selection: the query, the pages it selects (per
        sequence; the union is read, on demand), attention over them and the new token, the MLP."""
        started = time.perf_counter()
        residual, query, new_keys, new_values = self.model.qkv(weights, hidden, self.position)
        self.times.add(self.step, "compute_s", time.perf_counter() - started)
        started = time.perf_counter()
        state, bl = self.select_states[gpu_batch], self.backend_layer[layer]
        chosen = state.select(bl, query, self.position)                       # [batch, pages]
        pages = chosen.any(dim=0).nonzero().flatten().cpu()
        self.times.add(self.step, "select_s", time.perf_counter() - started)
        self.times.add(self.step, "pages_selected", float(pages.numel()))
        self.times.add(self.step, "pages_total", float(pages_of(self.position, state.spec.page)))
        handle = self._submit_page_load(layer, gpu_batch, pages)
        wait_started = time.perf_counter()
        keys, values = handle.result()
        waited = time.perf_counter() - wait_started
        self.load_wait_s += waited
        self.times.add(self.step, "load_wait_s", waited)
        started = time.perf_counter()
        n = keys.shape[2] - 1                     # the gathered tokens; the step's new one goes after them
        keys[:, :, n:].copy_(new_keys)
        values[:, :, n:].copy_(new_values)
        if chosen.shape[0] > 1 and not bool(chosen[:, pages.to(chosen.device)].all()):
            # each sequence attends to its own pages of the union read (and to its new token)
            page = state.spec.page
            token_pages = pages.repeat_interleave(page)[:n].to(chosen.device)
            allowed = torch.cat([chosen[:, token_pages], chosen.new_ones((chosen.shape[0], 1))], dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=allowed[:, None, None, :], scale=self.model.attention_scale,
                enable_gqa=query.shape[1] != keys.shape[1])
        else:
            out = attention(query, keys, values, scale=self.model.attention_scale)
        hidden = self.model.after_attention(weights, residual, out)
        self.times.add(self.step, "compute_s", time.perf_counter() - started)
        self.release((keys, values))
        return hidden, (new_keys, new_values)

    def store_hidden(self, gpu_batch: int, hidden: torch.Tensor) -> None:
        """Keep the layer's output for the next layer (in host memory when activations are offloaded)."""
        self.hidden[gpu_batch] = hidden.to("cpu", non_blocking=True) if self.runner.offload_activations else hidden

    def store_cache(self, layer: int, gpu_batch: int, new_kv: KVPair, full_kv: KVPair) -> None:
        """Keep (layer, GPU batch)'s KV on its tier.

        Offloaded: write the step's new tokens (prefill ``[start, prompt_len)``, decode the one at
        ``position``) to the backend, K then V, through the copy threads; waited for at once
        unless ``overlap``. On the device or in host memory: keep the whole KV (host: copied to
        host memory on CUDA).
        """
        tier = self.tiers[layer]
        if tier == "disk":
            if self.select_states:               # the selector's copy of K and the pages' versions
                started = time.perf_counter()
                self.select_states[gpu_batch].on_write(self.backend_layer[layer], self.position,
                                                       new_kv[0].permute(2, 0, 1, 3))
                self.times.add(self.step, "select_s", time.perf_counter() - started)
            self._submit_write(layer, gpu_batch, "k", new_kv[0])
            self._submit_write(layer, gpu_batch, "v", new_kv[1])
        else:
            to_host = tier == "cpu" and self.cuda
            keys, values = full_kv
            self.resident_kv[(layer, gpu_batch)] = (keys.to("cpu") if to_host else keys,
                                                    values.to("cpu") if to_host else values)

    def sample_tokens(self) -> torch.Tensor:
        """The LM head's greedy tokens (host copy): recorded with their float32 logits, fed to the next step."""
        logits = torch.cat([self.model.head(hidden.to(self.device)).float() for hidden in self.hidden], dim=0)
        tokens = logits.argmax(dim=-1)
        size = self.policy.gpu_batch_size
        self.inputs = [tokens[b * size:(b + 1) * size, None] for b in range(self.policy.num_gpu_batches)]
        host_tokens = tokens.cpu()
        self.out_tokens.append(host_tokens)
        self.out_logits.append(logits.cpu())
        return host_tokens

    def sync(self) -> float:
        """End the step: wait for its loads (the pipeline's measurement) and the device; the step's seconds."""
        self.pipeline.end_iteration()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.step_latencies.append(time.perf_counter() - self.step_started)
        self.times.add(self.step, "wall_s", self.step_latencies[-1])
        return self.step_latencies[-1]

    def all_finished(self, tokens: torch.Tensor, eos_token_id: int | None) -> bool:
        """Whether every sequence has now produced ``eos_token_id`` (never without one)."""
        if eos_token_id is None:
            return False
        self.finished = self.finished | (tokens == eos_token_id)
        return bool(self.finished.all())

    # -- the end of the run ----------------------------------------------
    def wait_for_writes(self) -> None:
        """Wait for every queued copy-thread job and write (a failed write raises); counted in the last step."""
        wait_started = time.perf_counter()
        self.copy_threads.drain()
        for write in self.writes:
            write.result()
        waited = time.perf_counter() - wait_started
        self.step_latencies[-1] += waited
        self.times.add(self.step, "wall_s", waited)

    def retain_kv(self) -> None:
        """Keep each backend's KV as a retained prefix: its sequence's prompt and the generated tokens fed back
        (the last one never was), written from token 0; the backend closes with it."""
        fed = torch.stack(self.out_tokens[:-1], dim=1) if len(self.out_tokens) > 1 else None
        for gpu_batch, backend in enumerate(self.backends):
            retain = getattr(backend, "retain", None)
            if retain is None:
                continue
            tokens = self.prompt_ids[gpu_batch].tolist() + ([] if fed is None else fed[gpu_batch].tolist())
            self.retained.append(dict(retain(tokens)))

    def result(self) -> GenerationResult:
        """The generated tokens and logits, the step latencies, and the KV path's stats, pipeline and plans."""
        steps = self.step_latencies
        policy = self.policy
        return GenerationResult(
            tokens=torch.stack(self.out_tokens, dim=1), logits=self.out_logits, prefill_latency=steps[0],
            decode_latency=sum(steps[1:]), step_latencies=steps, prompt_len=self.prompt_len,
            batch=policy.num_gpu_batches * policy.gpu_batch_size, stats=self.stats.as_dict(),
            pipeline=self.pipeline.report(), tiers=list(self.tiers),
            plans=[dict(getattr(backend, "plan", {}) or {}) for backend in self.backends],
            load_wait_s=self.load_wait_s, prefix_tokens=self.start, open_latency=self.open_latency,
            retained=self.retained, step_times=self.times.as_list(), select=self.select_report(),
        )

    def select_report(self) -> dict[str, Any]:
        """With ``kv_select``: the spec, the bytes held for it in this process (the selector's K copy or page
        summaries; the reuse buffers) and the share of the selecting layers' pages read over the decode steps."""
        if self.select is None:
            return {}
        steps = self.times.as_list()[1:]
        selected = sum(s["pages_selected"] for s in steps)
        total = sum(s["pages_total"] for s in steps)
        read = sum(s["pages_read"] for s in steps)
        return {"spec": self.select.describe(),
                "selector_bytes": sum(st.nbytes() for st in self.select_states),
                "reuse_buffer_bytes": sum(r.nbytes() for r in self.page_readers),
                "pages_selected": selected, "pages_total": total, "pages_read": read,
                "selected_share": round(selected / total, 4) if total else None,
                "reuse_hit_rate": round(1 - read / selected, 4) if selected else None}

    # -- the copy threads' jobs ------------------------------------------
    def _submit_load(self, layer: int, gpu_batch: int) -> LoadHandle:
        """Issue the load of tokens ``[0, position)`` of (layer, GPU batch)'s K and V.

        Per kind, on its copy thread: a read from the backend into the thread's staging slot, then
        a DMA from the slot to the device; scheduled by the pipeline's strategy for K's group.
        """
        backend, slots, backend_layer = self.backends[gpu_batch], self.slots[gpu_batch], self.backend_layer[layer]
        ntokens = self.position
        kinds: tuple[Kind, Kind] = ("k", "v")
        room = self.step_tokens
        step = self.step
        jobs = [LoadJob(read=partial(self._read_kv, step, backend, backend_layer, kind, ntokens),
                        dma=partial(self._copy_to_device, step, slots, self.channel[kind], ntokens, room,
                                    backend_layer, kind),
                        nbytes=ntokens * backend.geometry.token_bytes) for kind in kinds]
        return self.pipeline.load(jobs, backend.group(backend_layer, "k"))

    def _submit_page_load(self, layer: int, gpu_batch: int, pages: torch.Tensor) -> LoadHandle:
        """Issue the load of the selected ``pages`` of (layer, GPU batch)'s K and V: per kind, on its copy
        thread, the pages its reuse buffer lacks read into the staging slot, then the selected pages' tokens
        to the device with room for the step's new token."""
        backend, reader, bl = self.backends[gpu_batch], self.page_readers[gpu_batch], self.backend_layer[layer]
        ntokens, step = self.position, self.step
        kinds: tuple[Kind, Kind] = ("k", "v")

        def read(kind: Kind) -> Any:
            started = time.perf_counter()
            op, read_pages = reader.read(bl, kind, self.channel[kind], pages, ntokens)
            self.times.add(step, "read_s", time.perf_counter() - started)
            self.times.add(step, "read_bytes", getattr(op, "nbytes", 0))
            if kind == "k":
                self.times.add(step, "pages_read", float(read_pages))
                self.times.add(step, "reuse_hits", float(pages.numel() - read_pages))
            if getattr(op, "nbytes", 0):
                self.stats.add(op, True)
            return op

        def dma(kind: Kind) -> torch.Tensor:
            started = time.perf_counter()
            buf = self._borrow_buffer(backend.geometry)
            out = self.dma.run(lambda: reader.take(bl, kind, self.channel[kind], pages, ntokens, self.device,
                                                   self.cuda, room=1, out=buf), independent=True)
            self.times.add(step, "dma_s", time.perf_counter() - started)
            return out

        jobs = [LoadJob(read=partial(read, kind), dma=partial(dma, kind),
                        nbytes=int(pages.numel()) * reader.page * backend.geometry.token_bytes) for kind in kinds]
        # on the CPU, K's and V's gathers are the copy threads' own copies, on the critical path (the layer waits
        # for them): at once, not one after the other as a GPU link's DMAs (0.09-0.11 -> 0.08 s a step waiting
        # for loads, SmolLM2 keys:0.25, docs/kv-select.md)
        return self.pipeline.load(jobs, backend.group(bl, "k"), exclusive_dma=self.cuda)

    def _read_kv(self, step: int, backend: KVBackend, backend_layer: int, kind: Kind, ntokens: int) -> Any:
        """Copy thread: read tokens ``[0, ntokens)`` of a K or V into the thread's staging slot."""
        started = time.perf_counter()
        op = backend.read(backend_layer, kind, self.channel[kind], 0, ntokens)
        self.times.add(step, "read_s", time.perf_counter() - started)
        self.times.add(step, "read_bytes", getattr(op, "nbytes", 0))
        self.stats.add(op, True)
        return op

    def _copy_to_device(self, step: int, slots: SlotTensors, channel: int, ntokens: int, room: int,
                        backend_layer: int, kind: Kind) -> torch.Tensor:
        """Copy thread: DMA the staging slot's first ``ntokens`` tokens to the device, heads-first (decoded there
        from the KV format's rows; the newest ``kv_tail`` of them from the full-precision copy), into a tensor
        with ``room`` for the step's new tokens (``compute_layer`` writes them there)."""
        # reads host memory only (and the tail's copy, written on this thread's stream): no wait for the
        # compute stream, so it overlaps the layer computing now
        started = time.perf_counter()
        buf = self._borrow_buffer(slots.geometry)
        out = self.dma.run(lambda: slots.take(channel, ntokens, self.device, non_blocking=self.cuda,
                                              layer=backend_layer, kind=kind, room=room, out=buf), independent=True)
        self.times.add(step, "dma_s", time.perf_counter() - started)
        return out

    def _submit_write(self, layer: int, gpu_batch: int, kind: Kind, new: torch.Tensor) -> None:
        """Queue the write of ``new`` (this step's tokens of a K or V, at ``position``) on its copy thread."""
        channel = self.channel[kind]
        # CUDA: ``new`` is computed on this thread's stream; the copy thread's stream waits for that work
        job = partial(self._write_kv, self.step, self.backends[gpu_batch], self.slots[gpu_batch],
                      self.backend_layer[layer], kind, self.position, new, self.dma.produced())
        write = self.copy_threads.submit(channel, job)
        if not self.policy.overlap:
            write.result()
        self.writes.append(write)

    def _write_kv(self, step: int, backend: KVBackend, slots: SlotTensors, backend_layer: int, kind: Kind,
                  token_start: int, new: torch.Tensor, produced: Any = None) -> Any:
        """Copy thread: copy ``new`` into the staging slot at ``token_start`` (encoded in the KV format, on
        ``new``'s device; on CUDA once the compute stream has ``produced`` it), then write those tokens."""
        channel = self.channel[kind]
        started = time.perf_counter()
        self.dma.run(lambda: slots.put(channel, token_start, new, layer=backend_layer, kind=kind), after=produced)
        op = backend.write(backend_layer, kind, channel, token_start, new.shape[2])
        self.times.add(step, "write_s", time.perf_counter() - started)
        self.times.add(step, "write_bytes", getattr(op, "nbytes", 0))
        self.stats.add(op, False)
        return op


__all__ = ["STEP_FIELDS", "GenerationResult", "KVFactory", "Policy", "Runner", "StepTimes"]
