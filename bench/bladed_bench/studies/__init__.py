"""Every benchmark study of the harness, by name: ``bladectl bench STUDY`` / ``python -m bladed_bench STUDY``.

The registry names each study's module and says in one line what it measures; a study's module is imported only
when it runs (some import torch or transformers at the top), so ``bladectl bench --help`` stays fast. Each module
exposes ``main(argv: list[str] | None = None, prog: str | None = None) -> int``; ``tools/bench_*.py`` are shims
that run one study from the checkout (docs/benchmarks.md, "One command").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Study:
    name: str
    module: str          #: the module holding ``main``, imported when the study runs
    description: str     #: one line, for ``bladectl bench --help``
    tool: str            #: the checkout's shim that runs it (docs/benchmarks.md quotes them)
    #: the KV sweep's subcommands: ``main`` is :func:`bladed_bench.main.kv_main`, given the name as its first argument
    subcommand: bool = False


_LIST = (
    Study("sweep", "bladed_bench.main", "the KV memory-limit sweep (root: cgroups and drop_caches)",
          "tools/bench_kv.py sweep", subcommand=True),
    Study("run", "bladed_bench.main", "one KV-sweep configuration at one limit, summary to stdout",
          "tools/bench_kv.py run", subcommand=True),
    Study("report", "bladed_bench.main", "Markdown tables and PNG figures from KV-sweep JSON(s)",
          "tools/bench_kv.py report", subcommand=True),
    Study("delta", "bladed_bench.studies.delta", "before/after table of two KV-sweep JSONs (issue 13's rows)",
          "tools/kv_sweep_delta.py"),
    Study("pipeline-trial", "bladed_bench.studies.pipeline_trial",
          "A/B of the adaptive pipeline's trial in the KV sweep's workload (root)", "tools/ab_pipeline_trial.py"),
    Study("e2e", "bladed_bench.studies.e2e", "a real model's tokens/s under memory limits, bladed against the rest",
          "tools/bench_e2e.py"),
    Study("wear", "bladed_bench.studies.wear", "what a chat workload's KV cache makes the drive write (root)",
          "tools/bench_wear.py"),
    Study("engine", "bladed_bench.studies.engine", "bladed's I/O engine against fio, sequential write and read",
          "tools/bench_engine.py"),
    Study("requests", "bladed_bench.studies.requests", "request overhead of the data path against its yardsticks",
          "tools/bench_requests.py"),
    Study("prefix", "bladed_bench.studies.prefix", "prefix reuse in the runner: time to first token with and "
          "without", "tools/bench_prefix.py"),
    Study("codec", "bladed_bench.studies.codec", "the q8 / q4 codec's rates on this CPU, C against torch",
          "tools/bench_codec.py"),
    Study("pagecache-write", "bladed_bench.studies.pagecache_write",
          "the page-cache write path alone against pwrite and a shared mapping (root)",
          "tools/bench_pagecache_write.py"),
    Study("copy-limit", "bladed_bench.studies.copy_limit", "the machine's page-cache copy limit (pread, memcpy)",
          "tools/bench_copy_limit.py"),
    Study("accuracy", "bladed_bench.studies.accuracy", "accuracy cost of the KV formats on real text (issue 31)",
          "tools/bench_kv_accuracy.py"),
    Study("host-faults", "bladed_bench.studies.host_faults",
          "prefill's slow mode outside bladed: fresh page-cache writes on memory the host took back (root)",
          "tools/bench_host_faults.py"),
    Study("select", "bladed_bench.studies.kv_select", "accuracy of query-aware sparse decode reads (issue 47)",
          "tools/bench_kv_select.py"),
    Study("select-io", "bladed_bench.studies.select_io", "what a sparse decode step's reads cost in requests",
          "tools/bench_select_io.py"),
    Study("spike", "bladed_bench.studies.spike", "a neighbour's memory spike beside bladed's KV: who survives (root)",
          "tools/bench_spike.py"),
    Study("runner", "bladed_bench.studies.runner", "the runner's decode through bladed against the in-memory KV",
          "tools/bench_runner.py"),
    Study("vllm", "bladed_bench.studies.vllm", "bladed behind a real vLLM engine (needs .venv-vllm)",
          "tools/bench_vllm.py"),
)

#: name -> study, in the order ``--help`` lists them
STUDIES: dict[str, Study] = {s.name: s for s in _LIST}


def run(name: str, argv: list[str] | None, prog: str) -> int:
    """Import study ``name``'s module and run its ``main`` (``KeyError`` for a name the registry lacks)."""
    study = STUDIES[name]
    mod = importlib.import_module(study.module)
    args = [] if argv is None else list(argv)
    if study.subcommand:
        return int(mod.kv_main([name, *args], prog=prog))
    return int(mod.main(args, prog=prog))


def shim(name: str, tool: str) -> None:
    """The body of ``tools/bench_*.py``: run study ``name`` with this process's arguments, as ``tool``."""
    import sys

    sys.exit(run(name, sys.argv[1:], prog=tool))


__all__ = ["STUDIES", "Study", "run", "shim"]
