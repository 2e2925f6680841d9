"""``python -m bladed.runner`` as a user meets it: run as a real process, its stderr and exit status.

Every failure a user can cause is one line on stderr with a documented exit status (2 bad usage, 3
bladed not reachable, 4 an I/O or daemon-side error, 128+N a signal); progress goes to stderr (one
updating line on a terminal), results to stdout; the run says why generation stopped. Models are
the tiny random-weight ones (or a tiny checkpoint written here), so no test pays for SmolLM2.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemon_util import ROOT, DaemonProcess, end_process, ended, env_with_repo, short_tmpdir
from runner_util import CONFIGS, hf_model

from bladed.client import Client
from bladed.config import find_socket
from bladed.protocol import DaemonLostError
from bladed.runner.main import DAEMON_LOG, build_parser
from bladed.runner.weights import MODEL_CHOICES

PROG = "bladed-runner"
TINY = ["--model", "tiny-llama", "--prompt-len", "8"]
#: enough decode steps that a signal sent after the prefill always lands in the middle of the run
LONG = ["--gen-len", "500"]  # tiny-llama has 512 positions
TIMEOUT = 180.0


def runner(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bladed.runner", *args], cwd=ROOT, env=env_with_repo(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The last stderr line, checked to be the only error and not a traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.endswith("\n"), r.stderr
    return r.stderr.splitlines()[-1]


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir("bdr-") as d:
        yield d


class Live:
    """A runner process whose stderr lines are waited on as they come (reader threads, deadlines).

    :meth:`wait_line` takes the lines in the order the runner wrote them, each wait from the line after the
    previous wait's match: a line can only satisfy the wait that follows what it reports."""

    def __init__(self, *args: str, new_session: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bladed.runner", *args], cwd=ROOT, env=env_with_repo(),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=new_session)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._out: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self._out_reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._out_reader.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self._out.append(self.proc.stdout.read())

    def _next(self, deadline: float, what: str) -> str | None:
        left = deadline - time.monotonic()
        try:
            return self._q.get(timeout=max(left, 0.0))
        except queue.Empty:
            raise AssertionError(f"timed out waiting for {what}; stderr so far: {self.lines[-20:]}") from None

    def wait_line(self, prefix: str, timeout: float = TIMEOUT) -> str:
        """The first stderr line after the last one taken that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(deadline, f"a stderr line {prefix!r}")
            assert line is not None, f"the runner exited ({self.proc.wait()}) before {prefix!r}: {self.lines}"
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, str]:
        """Exit status and stdout; the rest of stderr lands in ``lines``."""
        deadline = time.monotonic() + timeout
        while (line := self._next(deadline, "the runner's exit (stderr at its end)")) is not None:
            self.lines.append(line)
        self._out_reader.join(max(deadline - time.monotonic(), 0.0))
        assert not self._out_reader.is_alive(), f"the runner's stdout is still open after {timeout:g} s"
        return self.proc.wait(max(deadline - time.monotonic(), 0.0)), self._out[0]

    def end(self) -> None:
        """End the runner and what it started (a spawned bladed): SIGTERM, SIGKILL after a grace period."""
        end_process(self.proc)


@contextlib.contextmanager
def live(*args: str, new_session: bool = False) -> Iterator[Live]:
    r = Live(*args, new_session=new_session)
    try:
        yield r
    finally:
        r.end()


def daemon_pid(line: str) -> int:
    """The pid in the runner's ``bladed: bladed/<version> (pid N) at ...`` line."""
    return int(line.split("(pid ", 1)[1].split(")", 1)[0])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"bladed.server" not in f.read()  # the pid was reused by something else
    except FileNotFoundError:
        return True


def journal_sessions(state_dir: str) -> list[Any]:
    with open(os.path.join(state_dir, "journal.json")) as f:
        return list(json.load(f)["sessions"])


# -- --help ---------------------------------------------------------------------------------------------

def test_help_explains_every_flag_with_its_default_and_the_exit_statuses() -> None:
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in flags), [a.option_strings for a in flags if not a.help]
    r = runner("--help")
    assert r.returncode == 0 and r.stderr == ""
    text = " ".join(r.stdout.split())  # unwrapped
    for a in flags:
        assert a.option_strings[0] in text
        if a.default not in (None, False):  # the others say their default in words
            shown = " ".join(f"{x:g}" for x in a.default) if isinstance(a.default, list) else (
                str(a.default).lower() if isinstance(a.default, bool) else str(a.default))
            assert f"(default: {shown})" in text, a.option_strings
    for flag in ("--prompt", "--prompt-len", "--dtype", "--device", "--stop-at-eos", "--state-dir"):
        assert "default: " in parser._option_string_actions[flag].help  # type: ignore[operator]
    for status in ("0 the text was generated", "2 bad usage", "3 bladed is not reachable",
                   "4 an I/O or daemon-side error", "128+N stopped by signal N (130: Ctrl-C)"):
        assert status in text


# -- bad usage: exit 2, one line, nothing run ------------------------------------------------------------

def _no_cuda_message(flag: str) -> str:
    why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
           else "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)")
    return f"--device {flag}: {why}; use --device cpu, or leave --device out to use CUDA only when available"


PERCENT_FIX = ("each pair (weights, cache, activations: gpu cpu) takes values in 0..100 that sum to at most 100, "
               "e.g. --percent 100 0 0 0 100 0")

USAGE = {
    "gen-len-0": (["--gen-len", "0"],
                  "--gen-len 0: the number of tokens to generate must be at least 1; give --gen-len 1 or more"),
    "gen-len-negative": (["--gen-len", "-3"],
                         "--gen-len -3: the number of tokens to generate must be at least 1; give --gen-len 1 or "
                         "more"),
    "prompt-len-0": (["--prompt-len", "0"],
                     "--prompt-len 0: the number of prompt tokens must be at least 1; give --prompt-len 1 or more"),
    "gpu-batch-size": (["--gpu-batch-size", "0"],
                       "--gpu-batch-size 0: the number of sequences per GPU batch must be at least 1; give "
                       "--gpu-batch-size 1 or more"),
    "num-gpu-batches": (["--num-gpu-batches", "-1"],
                        "--num-gpu-batches -1: the number of GPU batches must be at least 1; give --num-gpu-batches "
                        "1 or more"),
    "copy-threads": (["--copy-threads", "0"],
                     "--copy-threads 0: the number of copy threads must be at least 1; give --copy-threads 1 or "
                     "more"),
    "percent-cache-pair": (["--percent", "100", "0", "80", "80", "100", "0"],
                           "--percent 100 0 80 80 100 0: the cache pair sums to 80 + 80 = 160, more than 100; "
                           + PERCENT_FIX),
    "percent-weights-pair": (["--percent", "60", "50", "0", "0", "100", "0"],
                             "--percent 60 50 0 0 100 0: the weights pair sums to 60 + 50 = 110, more than 100; "
                             + PERCENT_FIX),
    "percent-range": (["--percent", "100", "0", "0", "0", "120", "0"],
                      "--percent 100 0 0 0 120 0: the activations gpu share 120 is outside 0..100; " + PERCENT_FIX),
    "percent-negative": (["--percent", "100", "0", "0", "-5", "100", "0"],
                         "--percent 100 0 0 -5 100 0: the cache cpu share -5 is outside 0..100; " + PERCENT_FIX),
    "unknown-model": (["--model", "gpt-5"], f"--model: unknown model 'gpt-5'; use {MODEL_CHOICES}"),
    "unknown-mode": (["--mode", "fast"], "argument --mode: unknown residency mode 'fast': choose one of baseline, "
                     "cachepolicy, direct, dualblade; see bladed-runner --help"),
    "not-a-number": (["--gen-len", "many"], "argument --gen-len: invalid int value: 'many'; see bladed-runner --help"),
    "prompt-and-prompt-len": (["--prompt", "hi", "--prompt-len", "4"],
                              "argument --prompt-len: not allowed with argument --prompt; see bladed-runner --help"),
    "device": (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"],
               _no_cuda_message("cuda") if not torch.cuda.is_available() else
               "--device tpu: expected cpu, cuda or cuda:N; leave --device out to use CUDA when available"),
}


@pytest.mark.parametrize("case", USAGE, ids=str)
def test_bad_usage_is_one_line_and_exit_2(case: str) -> None:
    args, message = USAGE[case]
    model = [] if "--model" in args else ["--model", "tiny-llama"]
    r = runner(*model, "--backend", "memory", *args)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"{PROG}: error: {message}\n", "")


def test_a_prompt_longer_than_the_model_positions_is_one_line_and_exit_2() -> None:
    r = runner("--model", "tiny-llama", "--backend", "memory", "--prompt-len", "600", "--gen-len", "4", "--json")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"{PROG}: error: a 600-token prompt plus gen_len 4 needs 603 positions, more than "
                        "tiny-llama's 512; shorten the prompt or gen_len (--prompt / --prompt-len, --gen-len)\n")


def test_prompt_text_for_a_model_without_tokenizer_is_refused() -> None:
    r = runner("--model", "tiny-llama", "--backend", "memory", "--prompt", "hello", "--json")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"{PROG}: error: --prompt: tiny-llama has no tokenizer (it takes token ids); give "
                        "--prompt-len N for a random N-token prompt, or a model with a tokenizer (smollm2 or a "
                        "checkpoint)\n")


def test_debug_adds_the_traceback_to_the_same_line() -> None:
    plain = runner("--model", "tiny-llama", "--backend", "memory", "--gen-len", "0")
    debug = runner("--model", "tiny-llama", "--backend", "memory", "--gen-len", "0", "--debug")
    assert plain.returncode == debug.returncode == 2
    assert debug.stderr.startswith("Traceback") and "UsageError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.rstrip("\n")


# -- bladed not reachable: exit 3 -------------------------------------------------------------------------

def _connect_error(path: str) -> str:
    with pytest.raises(DaemonLostError) as e:
        Client(socket_path=find_socket(path, given_as="--socket"))
    return str(e.value)


def test_no_daemon_names_the_socket_how_to_start_one_and_spawn_daemon(tmp: str) -> None:
    path = os.path.join(tmp, "bladed.sock")
    r = runner(*TINY, "--socket", path)
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr == f"{PROG}: error: {_connect_error(path)}; or add --spawn-daemon to run a private bladed " \
                       "for this run\n"
    assert path in r.stderr and "start bladed" in r.stderr


def test_a_stale_socket_is_not_a_daemon(tmp: str) -> None:
    path = os.path.join(tmp, "bladed.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)  # bound, never listening: what a killed daemon leaves behind
        r = runner(*TINY, "--socket", path)
        expected = _connect_error(path)
    assert (r.returncode, r.stdout) == (3, "")
    assert "refuses connections" in expected
    assert r.stderr == f"{PROG}: error: {expected}; or add --spawn-daemon to run a private bladed for this run\n"


def test_a_daemon_that_dies_mid_run_is_one_line_and_exit_3(tmp: str) -> None:
    with DaemonProcess(tmp) as d:
        d.start()
        with live(*TINY, *LONG, "--socket", d.socket_path) as r:
            r.wait_line("prefill: ")
            d.kill()
            rc, out = r.finish()
    assert (rc, out) == (3, "")
    assert "Traceback" not in "\n".join(r.lines)
    assert r.lines[-1] == (f"{PROG}: error: lost bladed at {d.socket_path} during the run (the daemon stopped, "
                           "crashed or restarted); see the daemon's log and run again")


# -- I/O or daemon-side: exit 4 ---------------------------------------------------------------------------

def test_spawning_into_a_busy_state_dir_fails_in_one_line_and_leaves_the_running_daemon_alone(tmp: str) -> None:
    with DaemonProcess(tmp) as d:
        d.start()
        r = runner(*TINY, "--gen-len", "2", "--spawn-daemon", "--state-dir", tmp)
        assert (r.returncode, r.stdout) == (4, "")
        line = error_line(r)
        assert line.startswith(f"{PROG}: error: the bladed started for --spawn-daemon exited with status ")
        assert f"another bladed (pid {d.pid}) is using the state directory {tmp}" in line
        assert line.endswith(f"(log: {os.path.join(tmp, DAEMON_LOG)})")
        with Client(socket_path=d.socket_path) as c:  # its socket is still there and still answers
            assert c.status()


def test_copy_threads_beyond_the_daemons_channels_is_refused_before_a_session(tmp: str) -> None:
    r = runner(*TINY, "--gen-len", "2", "--copy-threads", "64", "--spawn-daemon", "--state-dir", tmp)
    assert (r.returncode, r.stdout) == (2, "")
    assert error_line(r) == (f"{PROG}: error: --copy-threads 64: bladed at {tmp}/bladed.sock takes at most 8 "
                             "channels per session (its io.max_channels); give --copy-threads 8 or less")
    assert journal_sessions(tmp) == []


# -- signals: the session closed, the spawned daemon stopped, exit 128+N ------------------------------------

@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)],
                         ids=["ctrl-c-to-the-terminal-group", "sigterm-to-the-runner", "sighup-to-the-runner"])
def test_a_signal_mid_run_closes_the_session_stops_the_daemon_and_exits_128_plus_n(
        tmp: str, sig: signal.Signals, group: bool) -> None:
    with live(*TINY, *LONG, "--spawn-daemon", "--state-dir", tmp, new_session=True) as r:
        pid = daemon_pid(r.wait_line("bladed: "))
        r.wait_line("prefill: ")
        if group:
            os.killpg(r.proc.pid, sig)  # what a terminal does on Ctrl-C: the whole foreground group
        else:
            r.proc.send_signal(sig)
        rc, out = r.finish()
    assert (rc, out) == (128 + sig, "")
    assert "Traceback" not in "\n".join(r.lines)
    assert r.lines[-1] == f"{PROG}: interrupted ({sig.name}); KV sessions closed, spawned bladed stopped"
    assert gone(pid)
    assert journal_sessions(tmp) == []
    pc = os.path.join(tmp, "pagecache")
    assert not os.path.isdir(pc) or os.listdir(pc) == []
    with open(os.path.join(tmp, DAEMON_LOG)) as f:
        log = f.read()
    # the runner closed its session itself before it stopped the daemon (not the daemon's shutdown)
    closes = [ln for ln in log.splitlines() if "event=session_close " in ln]
    assert len(closes) == 1 and "reason=closed" in closes[0], closes
    assert "event=daemon_stop" in log


# -- progress and results ---------------------------------------------------------------------------------

def test_a_spawned_daemon_run_reports_progress_and_why_it_stopped(tmp: str) -> None:
    r = runner(*TINY, "--gen-len", "6", "--spawn-daemon", "--state-dir", tmp)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr  # not a terminal: plain lines
    # what it is doing, and the prefill; the decode rate at most every 10 s (none in so short a run, unless
    # the machine is very slow)
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith(("decode: ", "prefill: 1 x 8 tokens ..."))]
    assert lines[0] == f"starting bladed in {tmp} ..."
    assert lines[1].startswith("bladed: bladed/") and lines[1].endswith(
        f" at {tmp}/bladed.sock, log {os.path.join(tmp, DAEMON_LOG)}")
    assert lines[2] == "making tiny-llama with random weights ..."
    assert lines[3].startswith("prefill: 1 x 8 tokens in ") and lines[3].endswith(" s")
    assert len(lines) == 4
    assert gone(daemon_pid(lines[1]))
    out = r.stdout.splitlines()
    assert out[0] == "stopped: reached --gen-len 6"
    assert out[1].startswith("model size: ") and any(ln.startswith("decode latency: ") for ln in out)


def test_json_is_one_object_on_stdout_with_the_stop_reason_and_no_progress() -> None:
    r = runner(*TINY, "--backend", "memory", "--gen-len", "5", "--json")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.count("\n") == 1
    out = json.loads(r.stdout)
    assert (out["stop_reason"], out["gen_len"], out["gen_len_limit"]) == ("gen_len", 5, 5)


def test_a_terminal_gets_one_updating_progress_line_cleared_before_the_results() -> None:
    main_fd, sub_fd = pty.openpty()
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with ended(subprocess.Popen([sys.executable, "-m", "bladed.runner", *TINY, "--backend", "memory", "--gen-len",
                                 "6"], cwd=ROOT, env=env_with_repo(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=sub_fd)) as proc:
        os.close(sub_fd)
        got = b""
        with contextlib.suppress(OSError):  # EIO once the runner has closed the terminal
            while select.select([main_fd], [], [], TIMEOUT)[0] and (chunk := os.read(main_fd, 4096)):
                got += chunk
        os.close(main_fd)
        out = proc.communicate(timeout=TIMEOUT)[0].decode()
    assert proc.returncode == 0
    err = got.decode()
    # the steps and the decode rate rewrite one line in place; the prefill line stays
    assert "\rmaking tiny-llama with random weights ...\x1b[K" in err
    assert "\x1b[Kprefill: 1 x 8 tokens in " in err
    for i in range(2, 7):
        assert f"\rdecode: {i}/6 tokens, " in err
    assert err.endswith("\r\x1b[K")  # erased before the results are printed
    assert out.splitlines()[0] == "stopped: reached --gen-len 6"


@pytest.mark.slow
def test_a_model_that_ends_its_sequence_says_so(tmp: str) -> None:
    # a tiny checkpoint written here; its end-of-sequence token is one it generates at step 4
    ckpt = os.path.join(tmp, "tiny-ckpt")
    hf_model(CONFIGS["llama-gqa"], torch.float32).save_pretrained(ckpt)
    args = ["--model", ckpt, "--backend", "memory", "--prompt-len", "8", "--gen-len", "12", "--json"]
    free = runner(*args, "--stop-at-eos", "false")
    assert free.returncode == 0, free.stderr
    tokens = json.loads(free.stdout)["tokens"][0]
    first = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    at = max(first.values())  # the token whose first appearance is latest
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = tokens[at]
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg, f)
    r = runner(*args, "--stop-at-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["stop_reason"], out["gen_len"], out["tokens"][0]) == ("eos", at + 1, tokens[:at + 1])
    text = runner(*args[:-1], "--stop-at-eos")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == f"stopped: end-of-sequence token after {at + 1} of 12 tokens"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped exception, on purpose
def test_a_stop_signal_whose_exception_was_swallowed_still_stops_the_run() -> None:
    """The handler raises in whatever the main thread runs; inside a ``__del__`` Python prints and drops that
    exception, and the run would finish with status 0. The next step must raise it again."""
    from bladed.runner.main import Interrupted, _stop_on_signals, raise_if_interrupted

    class SignalledWhileFinalizing:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(1000):   # bytecodes: the handler runs here, and its exception is dropped
                pass

    with pytest.raises(Interrupted) as raised, _stop_on_signals():
        SignalledWhileFinalizing()
        raise_if_interrupted()
    assert raised.value.signum == signal.SIGHUP
