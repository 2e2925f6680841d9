#!/usr/bin/env python3
"""Real FlexGen (``flexgen`` 0.1.8 from PyPI, the paper's Baseline software) for ``tools/gpu/gpu_check.py`` (issue 41).

FlexGen is never part of bladed: its wheel (and ``attrs``, which it imports and a bare GPU box may lack) is
carried (``.gpu-carry/flexgen/``, filled by ``tools/gpu/gpu_check.py --prepare``; ``tools/setup.sh`` puts the same
wheels in ``var/wheels/flexgen/`` for rehearsals) and installed with ``pip --no-index --no-deps --target`` into a
private directory that only FlexGen's processes put on their path. Two roles:

* **harness** (imported; standard library only at import): :func:`install`, :func:`build_tokenizer`,
  :class:`FlexGenRunner` (one FlexGen process per run, in a memory cgroup of its own, cold like the
  end-to-end benchmark's runs, timed and counted the same way);
* **child** (``python3 tools/gpu/gpu_flexgen.py run --site DIR --tokenizer DIR --result FILE -- FLEXGEN ARGS``): in
  FlexGen's process, applies :data:`PATCHES` and runs FlexGen's own ``run_flexgen`` (``python -m
  flexgen.flex_opt``'s entry) with FlexGen's own argument parser, then writes what it measured to ``--result``.

The tokenizer. FlexGen loads ``facebook/opt-30b``'s tokenizer from the Hugging Face hub, which the box cannot
reach. With ``--path _DUMMY_`` its weights are all ones, so which BPE vocabulary encodes its prompt ("Paris is
the capital city of", left-padded to ``--prompt-len``) changes the token ids, never the work. The harness
builds a byte-level BPE tokenizer with no merges (``tokenizers``, which transformers depends on: nothing is
downloaded) with OPT's special ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3) and OPT's ``</s>`` first,
and the child points FlexGen's ``AutoTokenizer`` at it: the prompt is one id per byte after ``</s>`` (29, where
OPT's vocabulary has a word per id), padded with OPT's pad id (1), which FlexGen masks as it would.

The patches (the child's, never bladed's): ``tokenizer`` (above) and, in a rehearsal only, ``cpu-shim``: FlexGen
needs CUDA (streams, pinned buffers, ``cuda:0`` tensors), so on a machine without it the shim runs its
``cuda:0`` device on the CPU (streams and synchronisation become no-ops, pinning is dropped, ``Tensor.cuda``
returns the tensor). Everything else (the zig-zag loop, the ``.npy`` memmaps on disk, the copy threads, the
timers, the output ids) is FlexGen's code as published. No patch for today's torch is applied: the rehearsal
runs that code under this checkout's torch, numpy and transformers and would show one that is needed; the child
records the warnings FlexGen raised (deprecations to watch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this file is in tools/gpu/
#: what FlexGen needs that the GPU box lacks (pip name, version, import name); the box has torch, transformers,
#: numpy and tqdm; ``pulp`` is imported only by FlexGen's cost model (``experimental/``), never here
WHEELS: tuple[tuple[str, str, str], ...] = (("flexgen", "0.1.8", "flexgen"), ("attrs", "26.1.0", "attr"))
#: the wheels a rehearsal installs where there is no carry (``tools/setup.sh`` fetches them)
LOCAL_WHEELS = os.path.join(ROOT, "var", "wheels", "flexgen")
#: OPT's special tokens in id order (``facebook/opt-*``'s tokenizer: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3)
OPT_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
OPT_PAD, OPT_BOS = 1, 2
#: FlexGen's own prompt (``flexgen.flex_opt.get_test_inputs``), for the tokenizer check
FLEXGEN_PROMPT = "Paris is the capital city of"
PATCHES = {
    "tokenizer": "flexgen.flex_opt.AutoTokenizer loads the local tokenizer whatever hub name it is given",
    "cpu-shim": "rehearsal only: FlexGen's cuda:0 device on the CPU (torch.cuda streams, set_device and synchronize "
                "are no-ops, pin_memory is dropped, Tensor.cuda returns the tensor)",
}
MiB = 1 << 20


def wheels_in(folder: str) -> list[str]:
    """The carried FlexGen wheels in ``folder`` (every one of :data:`WHEELS`), or [] where one is missing."""
    found = []
    for name, version, _ in WHEELS:
        hit = glob.glob(os.path.join(folder, f"{name}-{version}-*.whl"))
        if not hit:
            return []
        found.append(hit[0])
    return found


def fetch(dest: str) -> list[str]:
    """Download :data:`WHEELS` into ``dest`` (PyPI, pure-Python wheels, no dependencies); kept when present."""
    have = wheels_in(dest)
    if have:
        return have
    os.makedirs(dest, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", dest,
                    *[f"{n}=={v}" for n, v, _ in WHEELS]], check=True)
    have = wheels_in(dest)
    if not have:
        raise SystemExit(f"{dest}: pip downloaded no wheel of {WHEELS}")
    return have


def install(wheels: Sequence[str], target: str, python: str = sys.executable, timeout: float = 120.0) -> str:
    """``pip install --no-index --no-deps --target TARGET`` of the FlexGen wheels; pip's output."""
    shutil.rmtree(target, ignore_errors=True)
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--disable-pip-version-check", "--target", target, *wheels],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"pip install of {[os.path.basename(w) for w in wheels]} failed: "
                           f"{(r.stdout + r.stderr).strip()[-600:]}")
    return r.stdout + r.stderr


def build_tokenizer(dest: str) -> dict[str, Any]:
    """The local stand-in for OPT's tokenizer (module doc) in ``dest``; what transformers makes of
    FlexGen's prompt with it. Needs ``tokenizers`` and ``transformers``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(OPT_SPECIALS)}
    vocab.update({ch: len(OPT_SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # OPT's tokenizer puts </s> first (its bos_token)
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A </s> $B",
                                                       special_tokens=[("</s>", OPT_BOS)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in OPT_SPECIALS])
    os.makedirs(dest, exist_ok=True)
    tok.save(os.path.join(dest, "tokenizer.json"))
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 2048,
                   "padding_side": "left"}, f, indent=1)
    return check_tokenizer(dest)


def check_tokenizer(path: str, prompt_len: int = 40) -> dict[str, Any]:
    """Encode FlexGen's prompt as FlexGen does (left-padded to ``prompt_len``); ValueError unless the ids start
    with OPT's pad ids (FlexGen masks that id) and decode back to the prompt. ``bos_first``: OPT's ``</s>``
    leads the prompt's ids, as with OPT's own tokenizer (a transformers version could drop it: reported)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    ids = tok([FLEXGEN_PROMPT], padding="max_length", max_length=prompt_len).input_ids[0]
    n_pad = prompt_len - len(tok(FLEXGEN_PROMPT).input_ids)
    text = tok.decode(ids, skip_special_tokens=True)
    out = {"class": type(tok).__name__, "vocab": len(tok), "pad_token_id": tok.pad_token_id,
           "prompt_ids": ids, "prompt_tokens": prompt_len - n_pad, "decoded": text,
           "bos_first": len(ids) > n_pad and ids[n_pad] == OPT_BOS}
    if (tok.pad_token_id != OPT_PAD or ids[:n_pad] != [OPT_PAD] * n_pad or OPT_PAD in ids[n_pad:]
            or text != FLEXGEN_PROMPT or len(ids) != prompt_len):
        raise ValueError(f"the local tokenizer in {path} does not encode FlexGen's prompt as OPT's would (pad id 1 "
                         f"on the left, then </s> 2): {out}; rebuild it with tools/gpu/gpu_flexgen.py tokenizer DIR")
    return out


# -- the harness: one FlexGen process per run ------------------------------------------------------------

@dataclasses.dataclass
class FlexGenPlan:
    """What every FlexGen run generates, and where: its flags are FlexGen's own (``--help`` of flex_opt)."""

    model: str                   # facebook/opt-6.7b
    batch: int
    prompt_len: int
    gen_len: int
    site: str                    # where :func:`install` put FlexGen
    tokenizer: str               # :func:`build_tokenizer`'s directory
    workdir: str                 # the offload directory goes here: on the disk under test
    cpu_shim: bool = False       # a rehearsal: the ``cpu-shim`` patch
    timeout_s: float = 900.0

    def flexgen_args(self, offload_dir: str, log_file: str, gen_len: int | None = None) -> list[str]:
        """FlexGen's command line: dummy weights, every weight and activation on the GPU, the KV cache on disk."""
        return ["--model", self.model, "--path", "_DUMMY_", "--offload-dir", offload_dir,
                "--percent", "100", "0", "0", "0", "100", "0", "--gpu-batch-size", str(self.batch),
                "--num-gpu-batches", "1", "--prompt-len", str(self.prompt_len),
                "--gen-len", str(gen_len or self.gen_len), "--log-file", log_file]


def kv_bytes(model: str, batch: int, tokens: int) -> int:
    """FlexGen's KV set at ``tokens`` positions (``OptConfig.cache_bytes``: K and V, fp16), from bladed's shape
    of the model (the same layers and hidden size)."""
    from bladed.runner.models import opt_config

    cfg = opt_config(model)
    return 2 * batch * tokens * cfg.num_layers * cfg.hidden_size * 2


class _CgroupSampler:
    """The cgroup's counters every ``interval`` seconds in a thread, their peaks kept."""

    def __init__(self, cg: Any, interval: float = 0.1) -> None:
        import threading

        self.cg, self.interval = cg, interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flexgen-cgroup-sampler", daemon=True)

    def _sample(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for k, v in _cgroup_sample(self.cg).items():
                self.peak[k] = max(self.peak.get(k, 0), int(v))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> _CgroupSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak


def _cgroup_sample(cg: Any) -> dict[str, float]:
    stat = cg.stat()
    out = {k: float(stat[k]) for k in ("anon", "file", "rss", "cache", "kernel", "shmem", "sock") if k in stat}
    out["usage"] = float(cg.usage())
    # what the process holds besides the page cache (v2 file, v1 cache): its heap, pinned buffers, kernel memory
    out["non_file"] = out["usage"] - out.get("file", out.get("cache", 0.0))
    return out


class FlexGenRunner:
    """Runs FlexGen once per call: cold (``settle``), its process in a fresh memory cgroup (the whole process: it
    owns the KV's page cache), the device's and the process's disk I/O counted, the timings its own timers took."""

    def __init__(self, plan: FlexGenPlan, *, cgroups: bool, settle: Callable[[], dict[str, Any]] | None = None,
                 env: dict[str, str] | None = None) -> None:
        from bladed_bench.metrics import block_device_of

        self.plan = plan
        self.cgroups = cgroups
        self.settle = settle
        self.env = dict(env if env is not None else os.environ)
        # no network on the box: nothing may wait for the hub
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        os.makedirs(plan.workdir, exist_ok=True)
        self.sysdir = block_device_of(plan.workdir)

    def argv(self, offload_dir: str, result: str, log_file: str, gen_len: int | None = None) -> list[str]:
        p = self.plan
        return [sys.executable, os.path.abspath(__file__), "run", "--site", p.site, "--tokenizer", p.tokenizer,
                "--result", result, *(["--cpu-shim"] if p.cpu_shim else []), "--",
                *p.flexgen_args(offload_dir, log_file, gen_len)]

    def run(self, limit: int | None, *, cold: bool = True, gen_len: int | None = None,
            timeout_s: float | None = None) -> dict[str, Any]:
        """One FlexGen process; its cgroup's hard limit ``limit`` bytes (None: none). A run that failed has an
        ``error`` (the cause: FlexGen's last lines, the OOM killer, the timeout) and what was measured."""
        rec: dict[str, Any] = {"side": "flexgen", "limit_bytes": limit, "gen_len": gen_len or self.plan.gen_len,
                               "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        try:
            self._run(rec, limit, cold, gen_len, timeout_s)
        except Exception as e:  # one failed run must not lose the sweep
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec

    def _run(self, rec: dict[str, Any], limit: int | None, cold: bool, gen_len: int | None,
             timeout_s: float | None) -> None:
        from bladed_bench.cgroup import MemCgroup
        from bladed_bench.metrics import DiskStat

        p = self.plan
        offload = os.path.join(p.workdir, "flexgen-offload")
        result = os.path.join(p.workdir, "flexgen-result.json")
        log_file = os.path.join(p.workdir, "flexgen.log")
        shutil.rmtree(offload, ignore_errors=True)
        os.makedirs(offload)
        for f in (result, log_file):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
        if cold and self.settle is not None:
            rec.update(self.settle())
        cg = MemCgroup(limit, prefix="bladed-e2e-flexgen") if self.cgroups else None
        argv = self.argv(offload, result, log_file, gen_len)
        rec["argv"] = argv[2:]
        sampler = _CgroupSampler(cg).start() if cg is not None else None
        before = DiskStat.read(self.sysdir) if self.sysdir is not None else None
        out = ""
        try:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cg.launcher(argv) if cg else argv, cwd=p.workdir, env=self.env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                out, _ = proc.communicate(timeout=timeout_s or p.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                raise RuntimeError(f"FlexGen took more than {timeout_s or p.timeout_s:.0f} s") from None
            rec["process_s"] = round(time.perf_counter() - t0, 3)
            if proc.returncode != 0:
                last = [ln for ln in out.strip().splitlines() if ln.strip()][-3:] or ["(no output)"]
                oom = cg is not None and cg.events().get("oom_kill", 0) > 0
                raise RuntimeError(("killed by the OOM killer of its cgroup: " if oom else "") +
                                   f"FlexGen exited with status {proc.returncode}: {' | '.join(last)}")
        finally:
            if before is not None and self.sysdir is not None:
                d = DiskStat.read(self.sysdir).delta(before)
                rec["device"] = {k: d.get(k) for k in ("read_bytes", "write_bytes", "seconds")}
            if cg is not None and sampler is not None:
                rec["cgroup"] = {"version": cg.version, "path": cg.path, "limit_bytes": cg.limit(),
                                 "peak_bytes": cg.peak(), "failcnt": cg.failcnt(), "events": cg.events(),
                                 "peak_stat": sampler.stop()}
                cg.remove()
            rec["output_tail"] = "\n".join(out.strip().splitlines()[-12:])
            shutil.rmtree(offload, ignore_errors=True)
        try:
            with open(result) as f:
                rec.update(json.load(f))
        except (OSError, ValueError) as e:
            raise RuntimeError(f"FlexGen exited 0 but wrote no result ({e})") from None


# -- the child: FlexGen's own process ------------------------------------------------------------------

def _cpu_shim(torch: Any, backend: Any) -> None:
    """Rehearsal only (:data:`PATCHES`): FlexGen's ``cuda:0`` device on the CPU."""
    class Stream:                     # torch.cuda.Stream's stand-in: FlexGen only enters and syncs it
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    empty = torch.empty

    def no_pin_empty(*a: Any, pin_memory: bool = False, **k: Any) -> Any:
        return empty(*a, **k)

    torch.cuda.Stream = Stream
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
    torch.cuda.set_device = lambda *_a, **_k: None
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.cuda.memory_allocated = lambda *_a, **_k: 0
    torch.cuda.max_memory_allocated = lambda *_a, **_k: 0
    torch.empty = no_pin_empty
    torch.Tensor.pin_memory = lambda self, *_a, **_k: self
    torch.Tensor.cuda = lambda self, *_a, **_k: self
    init = backend.TorchDevice.__init__

    def device_init(self: Any, name: str, *a: Any, **k: Any) -> None:
        init(self, name, *a, **k)
        if self.device_type == backend.DeviceType.CUDA:
            self.dev = torch.device("cpu")   # FlexGen still takes it for its GPU (device_type CUDA)

    backend.TorchDevice.__init__ = device_init


def _version(dist: str) -> str | None:
    """The installed version of ``dist`` (its dist-info on the path: the private directory's first)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _proc_io() -> dict[str, int] | None:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except (OSError, ValueError):
        return None


def child_main(a: argparse.Namespace, flexgen_argv: list[str]) -> int:
    """In FlexGen's process: patch, run ``run_flexgen``, write the result (the module doc)."""
    import resource
    import warnings

    sys.path.insert(0, a.site)
    t_start = time.perf_counter()
    caught: list[str] = []
    warnings.simplefilter("default")
    show = warnings.showwarning

    def keep(message: Any, category: Any, filename: str, lineno: int, *rest: Any, **kw: Any) -> None:
        caught.append(f"{category.__name__}: {message} ({os.path.basename(filename)}:{lineno})")
        show(message, category, filename, lineno, *rest, **kw)

    warnings.showwarning = keep
    import flexgen
    import flexgen.flex_opt as fo
    import flexgen.pytorch_backend as backend
    import torch
    import transformers
    from flexgen.timer import timers

    applied = ["tokenizer"]

    class LocalTokenizer:
        """``AutoTokenizer`` as FlexGen calls it, on the local tokenizer (module doc)."""

        @staticmethod
        def from_pretrained(_name: str, *args: Any, **kw: Any) -> Any:
            return transformers.AutoTokenizer.from_pretrained(a.tokenizer, *args, **kw)

    fo.AutoTokenizer = LocalTokenizer
    if a.cpu_shim:
        _cpu_shim(torch, backend)
        applied.append("cpu-shim")
    calls: list[dict[str, Any]] = []
    generate, opt_init = fo.OptLM.generate, fo.OptLM.__init__

    def timed_generate(self: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(self, *args, **kw)
        calls.append({"seconds": time.perf_counter() - t0, "ids": out.copy()})
        return out

    def timed_init(self: Any, *args: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        opt_init(self, *args, **kw)
        calls.append({"init_s": time.perf_counter() - t0})

    fo.OptLM.generate, fo.OptLM.__init__ = timed_generate, timed_init
    parser = argparse.ArgumentParser(prog="flexgen.flex_opt")
    fo.add_parser_arguments(parser)
    args = parser.parse_args(flexgen_argv)
    imported_s = time.perf_counter() - t_start
    io0 = _proc_io()
    fo.run_flexgen(args)
    io1 = _proc_io()
    costs = list(timers("generate").costs)
    runs = [c for c in calls if "ids" in c]
    if len(runs) != 2 or len(costs) != args.gen_len:
        raise RuntimeError(f"FlexGen ran {len(runs)} generate calls and timed {len(costs)} steps; expected its "
                           f"warm-up and one benchmark of {args.gen_len} steps (flexgen {flexgen.__file__} is not "
                           "0.1.8?)")
    ids = runs[-1]["ids"]
    batch, plen = ids.shape[0], args.prompt_len
    prefill, decode = costs[0], sum(costs[1:])
    with contextlib.suppress(OSError), open(args.log_file) as f:
        log = f.read()
    result = {
        "flexgen": _version("flexgen"),
        "flexgen_file": flexgen.__file__, "torch": torch.__version__, "transformers": transformers.__version__,
        "patches": applied, "warnings": sorted(set(caught))[:20], "import_s": round(imported_s, 3),
        "init_s": round(next((c["init_s"] for c in calls if "init_s" in c), 0.0), 3),
        "warmup_s": round(runs[0]["seconds"], 3), "generate_s": round(runs[-1]["seconds"], 3),
        # FlexGen's own timers: costs[0] the prefill, costs[1:] the decode steps (its log's figures)
        "ttft_s": prefill, "prefill_s": prefill, "decode_s": decode,
        "prefill_tok_s": batch * plen / prefill if prefill else 0.0,
        "decode_tok_s": batch * (args.gen_len - 1) / decode if decode else 0.0,
        "steps": [{"step": i, "wall_s": round(c, 6)} for i, c in enumerate(costs)],
        "prompt_ids": ids[0, :plen].tolist(), "tokens": ids[:, plen:].tolist(),
        "owner_io": None if io0 is None or io1 is None else {
            k: io1[k] - io0[k] for k in ("read_bytes", "write_bytes", "rchar", "wchar") if k in io1},
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "flexgen_log": log.strip().splitlines() if log else [],
    }
    with open(a.result + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(a.result + ".tmp", a.result)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flexgen_argv: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, flexgen_argv = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="tools/gpu/gpu_flexgen.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="in FlexGen's process: patch, run FlexGen with the arguments after --")
    r.add_argument("--site", required=True, help="where FlexGen was installed (pip --target)")
    r.add_argument("--tokenizer", required=True, help="the local tokenizer's directory")
    r.add_argument("--result", required=True, help="the JSON written at the end")
    r.add_argument("--cpu-shim", action="store_true", help="a rehearsal: FlexGen's cuda:0 device on the CPU")
    t = sub.add_parser("tokenizer", help="build the local tokenizer in DIR and print its check")
    t.add_argument("dir")
    f = sub.add_parser("fetch", help="download the FlexGen wheels into DIR (kept when present)")
    f.add_argument("dir")
    a = p.parse_args(argv)
    if a.cmd == "run":
        if not flexgen_argv:
            p.error("give FlexGen's own arguments after --, e.g. -- --model facebook/opt-125m --path _DUMMY_")
        return child_main(a, flexgen_argv)
    if a.cmd == "tokenizer":
        print(json.dumps(build_tokenizer(a.dir)))
        return 0
    for w in fetch(a.dir):
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
