"""Protocol fuzzing against a real daemon: malformed, truncated, oversized and
out-of-order frames, bad descriptors, wrong descriptor counts, and valid frames
with hostile values (negative/huge sizes, layers and tokens past the tensor,
unknown and foreign session ids, ...).

Every case must be answered with an error reply or a closed connection (never
silence, never an ``internal`` error, which would be a daemon bug); the daemon
must not crash, leak descriptors or sessions, and must still serve a
well-behaved client afterwards.

Cases are cheap: they are generated from a seeded ``random.Random`` and sent
pipelined over one connection (32 frames, then their replies); a case that
breaks the stream closes the connection and the fuzzer reconnects.  The CI run
tries 100,000 cases (``BLADED_FUZZ_CASES`` to change it; ``tests/reliability.py
fuzz`` for long runs).  A hypothesis test drives the same generator with
hypothesis-chosen seeds, so a failure shrinks to a reproducible seed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from daemon_util import DaemonProcess, short_tmpdir, wait_connections
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from bladed.client import MODES, Client
from bladed.protocol import (
    FRAME_FORMAT,
    HEADER,
    IO_FORMAT,
    IO_RANGE,
    IO_REQUEST,
    MAGIC,
    MAX_FDS,
    MAX_FRAME_BYTES,
    OPS,
    PROTOCOL_VERSION,
    ConnectionClosed,
    ErrorCode,
    FrameError,
    FrameReader,
    decode_io_reply,
    encode,
    send_frame,
)
from bladed.server.sessions.rules import MAX_LAYERS
from bladed.sizes import align_up

GEOMETRY = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
TOKEN = 4096
SLOT = 8 * TOKEN
BATCH = 32
CI_CASES = int(os.environ.get("BLADED_FUZZ_CASES", "100000"))

FUZZ_CONFIG = {"io": {"max_outstanding": 4, "send_timeout_s": 5.0, "max_staging_bytes": 8 * SLOT,
                      "max_channels": 4},
               # two layers' K+V on the page-cache path, the rest direct: both paths get fuzzed
               "budget": {"override": 4 * SLOT}}

HOSTILE_INTS = [0, 1, -1, 2, 3, 7, 8, 9, -2**31, 2**31 - 1, 2**31, 2**32, -2**63, 2**63 - 1, 2**63, 2**64,
                10**30, -10**30, 4096, 4097, 1 << 40]
FIELDS = ["op", "id", "session", "layer", "kind", "channel", "token_start", "ntokens", "geometry", "mode",
          "channels", "staging_bytes", "protocol", "client", "lba", "slba", "tensor_id"]


def staging_memfd(size: int = 2 * SLOT, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    fd = os.memfd_create("fuzz-staging", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@dataclass
class Case:
    """One fuzz case: bytes to send (one frame, or garbage), descriptors, and what may happen."""

    raw: bytes
    fds: list[int] = field(default_factory=list)
    #: True when the case breaks the frame stream: the daemon answers bad_frame (or nothing) and closes
    breaks: bool = False
    #: a large frame: sent on its own and answered before the next one (no pipelining)
    solo: bool = False
    kind: str = ""


def frame(body: bytes, fmt: int = FRAME_FORMAT, magic: bytes = MAGIC, length: int | None = None) -> bytes:
    return HEADER.pack(magic, fmt, 0, len(body) if length is None else length) + body


class Generator:
    """Builds fuzz cases from a seeded Random; knows the live session ids to aim hostile values at."""

    def __init__(self, rng: random.Random, own: list[str], foreign: list[str]) -> None:
        self.rng = rng
        self.own = own
        self.foreign = foreign
        self.next_id = 1

    def value(self, depth: int = 0) -> object:
        r = self.rng
        x = r.random()
        if x < 0.35:
            return r.choice(HOSTILE_INTS) + r.choice([0, 0, 0, 1, -1])
        if x < 0.45:
            return r.choice(["k", "v", "K", "", "kv", "x" * r.randint(0, 300), "\u00e9\u2603", "\ud800", "0"])
        if x < 0.55:
            return r.choice(self.own + self.foreign + ["", "nope", "00000000", "../../etc"])
        if x < 0.62:
            return r.choice([None, True, False, 1.5, -0.0, 1e308, float(r.randint(0, 9))])
        if x < 0.70:
            return r.choice(OPS)
        if x < 0.78 and depth < 2:
            return [self.value(depth + 1) for _ in range(r.randint(0, 3))]
        if x < 0.86 and depth < 2:
            return {r.choice(FIELDS): self.value(depth + 1) for _ in range(r.randint(0, 4))}
        if x < 0.93:
            return dict(GEOMETRY, **{r.choice(list(GEOMETRY)): r.choice(HOSTILE_INTS)})
        return r.randint(-10, 10)

    def request(self) -> dict[str, object]:
        """A mostly well-formed request with a few hostile fields."""
        r = self.rng
        op = r.choice(["read", "read", "write", "write", "close_session", "open_session", "status", "stats",
                       "sessions", "budget", "trim", "hello", "frobnicate", ""])
        req_id: object = self.next_id
        self.next_id += 1
        body: dict[str, object] = {"op": op, "id": req_id}
        if op in ("read", "write", "close_session"):
            # a session of ours mostly; closing it is rarer (the fuzzer then reconnects)
            pool = self.own * 3 if op != "close_session" or r.random() < 0.1 else []
            body.update(session=r.choice(pool + self.foreign + ["nope"]), layer=r.randint(-1, 5),
                        kind=r.choice("kkvvq"), channel=r.randint(-1, 2), token_start=r.randint(-1, 9),
                        ntokens=r.choice([None, 0, 1, 2, 8, 9, -1, 2**63]))
        elif op == "open_session":
            body.update(geometry=dict(GEOMETRY), channels=r.randint(0, 3), staging_bytes=r.choice([SLOT, 2 * SLOT]),
                        mode=r.choice(["dualblade", "direct", "baseline", "cachepolicy", "Dual-Blade", "turbo"]))
        elif op == "hello":
            body["protocol"] = r.choice([PROTOCOL_VERSION, 0, 99, "1", None])
        for _ in range(r.choice([0, 0, 1, 1, 2, 3])):
            body[r.choice(FIELDS)] = self.value()
        if r.random() < 0.03:
            del body["id"]
        return body

    def case(self) -> Case:
        r = self.rng
        x = r.random()
        if x < 0.012:
            return self.breaker()
        if x < 0.75:
            body = self.request()
            try:
                data = json.dumps(body).encode("utf-8", "surrogatepass")
            except ValueError:
                data = b"{}"
            return Case(frame(data), kind=f"request:{body.get('op')}")
        if x < 0.85:
            # well-framed bodies that are not JSON objects, or JSON the parser struggles with
            body = r.choice([b"", b"{", b"[1,2]", b"null", b'"s"', b"\xff\xfe\x00", b"{" * 3000 + b"}" * 3000,
                             b'{"op":"status","id":' + b"9" * 5000 + b"}", b'{"id":NaN,"op":"status"}',
                             b'{"op":"read","id":1,"layer":1e999}', b'{"a":' * 200 + b"1" + b"}" * 200,
                             bytes(r.randrange(256) for _ in range(r.randint(1, 40)))])
            return Case(frame(body), kind="body")
        if x < 0.92:
            # descriptors: the right op with the wrong things, or the wrong op with descriptors
            return self.fd_case()
        if x < 0.96:
            # oversized but legal: a near-limit body full of junk fields
            pad = "x" * r.choice([1000] * 20 + [100_000] * 3 + [MAX_FRAME_BYTES - 200])
            body = {"op": r.choice(["status", "frobnicate", pad[:64]]), "id": self.next_id, "pad": pad}
            self.next_id += 1
            if r.random() < 0.5:
                body = {"op": pad, "id": self.next_id}  # a huge op name is echoed in the error message
            return Case(frame(json.dumps(body).encode()), solo=True, kind="oversized")
        # ordinary requests with junk fields make up the rest
        return Case(frame(json.dumps({"op": r.choice(OPS), "id": self.next_id, "x": self.value()}).encode(
            "utf-8", "surrogatepass")), kind="junk")

    def breaker(self) -> Case:
        """Frame-level breakage: bad magic, unknown format, over-limit length, truncation."""
        r = self.rng
        choice = r.randrange(5)
        if choice == 0:
            raw = frame(b"{}", magic=bytes([r.randrange(256), r.randrange(256)]))
            return Case(raw, breaks=raw[:2] != MAGIC, kind="magic")
        if choice == 1:
            return Case(frame(b"{}", fmt=r.choice([0, 2, 255])), breaks=True, kind="format")
        if choice == 2:
            return Case(frame(b"", length=r.choice([MAX_FRAME_BYTES + 1, 2**32 - 1])), breaks=True, kind="length")
        if choice == 3:
            # the last frame promises more than it carries: the connection ends mid-frame
            return Case(frame(b'{"op":"status"}', length=r.randint(16, 200)), breaks=True, kind="truncated")
        return Case(frame(b"{}")[: r.randint(1, 7)], breaks=True, kind="short-header")

    def fd_case(self) -> Case:
        r = self.rng
        fds: list[int] = []
        n = r.choice([0, 1, 1, 1, 1, 1, 2, 2, MAX_FDS, MAX_FDS] + [MAX_FDS + 1] * (r.random() < 0.3))
        for _ in range(n):
            k = r.randrange(7)
            if k == 0:
                fds.append(staging_memfd(2 * SLOT))
            elif k == 1:
                fds.append(staging_memfd(2 * SLOT, seals=0))                      # unsealed
            elif k == 2:
                fds.append(staging_memfd(SLOT // 2))                              # short
            elif k == 3:
                fds.append(staging_memfd(2 * SLOT, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE))  # unmappable
            elif k == 4:
                rd, wr = os.pipe()
                os.close(wr)
                fds.append(rd)                                                    # not a memfd
            elif k == 5:
                fds.append(os.open("/dev/zero", os.O_RDWR | os.O_CLOEXEC))
            else:
                fds.append(os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        op = r.choice(["open_session", "open_session", "open_session", "status", "read"])
        body = {"op": op, "id": self.next_id, "geometry": GEOMETRY, "channels": r.choice([1, 2]),
                "staging_bytes": r.choice([SLOT, 2 * SLOT, 3 * SLOT]), "session": r.choice(self.own or ["x"]),
                "layer": 0, "kind": "k", "channel": 0}
        self.next_id += 1
        return Case(frame(json.dumps(body).encode()), fds=fds, breaks=n > MAX_FDS, kind=f"fds:{op}:{n}")


class Fuzzer:
    """Drives cases into one daemon, checking every reply; reconnects when a case breaks the stream."""

    def __init__(self, socket_path: str, seed: int) -> None:
        self.path = socket_path
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        # a session on another connection: its id must be unreachable from ours
        self.other = Client(socket_path)
        self.other_sess = self.other.open_session(GEOMETRY, channels=1)
        self.other_sess.slot(0)[:] = b"\xa5" * SLOT
        self.other_sess.write(3, "v", 0)
        self.own: list[str] = []
        self.gen = Generator(self.rng, self.own, [self.other_sess.id])
        self.sock: socket.socket | None = None
        self.reader: FrameReader | None = None
        self.connect()

    def connect(self) -> None:
        """The main connection: greeted, with a session of its own; it lives through the whole run."""
        if self.sock is not None:
            self.sock.close()
        self.sock, self.reader = self.dial(greet=True)
        self.own.clear()
        fd = staging_memfd(2 * SLOT)
        try:
            send_frame(self.sock, {"op": "open_session", "id": 0, "geometry": GEOMETRY, "channels": 2,
                                   "staging_bytes": 2 * SLOT}, [fd])
        finally:
            os.close(fd)
        reply = self.reader.read().body
        assert reply["ok"], reply
        self.own.append(reply["session"])

    def dial(self, *, greet: bool) -> tuple[socket.socket, FrameReader]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(30)
        sock.connect(self.path)
        reader = FrameReader(sock)
        self.counts["connections"] += 1
        if greet:
            send_frame(sock, {"op": "hello", "id": 0, "protocol": PROTOCOL_VERSION})
            assert reader.read().body["ok"]
        return sock, reader

    def check(self, body: dict[str, object]) -> bool:
        """One reply; returns False when it announces that the connection closes."""
        assert isinstance(body, dict) and "id" in body and isinstance(body.get("ok"), bool), body
        if body["ok"]:
            self.codes["ok"] += 1
            sid = body.get("session")
            if isinstance(sid, str) and "plan" in body:
                self.own.append(sid)
            elif isinstance(sid, str) and sid in self.own:
                self.own.remove(sid)  # close_session of one of ours
            return True
        err = body["error"]
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], body
        code = ErrorCode(err["code"])
        assert code is not ErrorCode.INTERNAL, f"daemon bug: {body}"
        self.codes[code.value] += 1
        return code not in (ErrorCode.BAD_FRAME, ErrorCode.HANDSHAKE_REQUIRED, ErrorCode.INCOMPATIBLE_PROTOCOL)

    def send(self, case: Case, sock: socket.socket | None = None) -> bool:
        sock = sock or self.sock
        assert sock is not None
        try:
            if case.fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, "little") for fd in case.fds))]
                n = sock.sendmsg([case.raw[:1]], anc)
                sock.sendall(case.raw[n:])
            else:
                sock.sendall(case.raw)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False
        finally:
            for fd in case.fds:
                os.close(fd)

    def side(self, case: Case) -> None:
        """A stream-breaking case on a connection of its own (greeted or not): replies, then a close."""
        greet = self.rng.random() < 0.8
        sock, reader = self.dial(greet=greet)
        try:
            if not greet:
                # out of order: anything but hello first must get handshake_required (or bad_request, no id)
                pre = self.gen.case()
                while pre.breaks or pre.solo:
                    pre = self.gen.case()
                self.send(pre, sock)
                self.counts["ungreeted"] += 1
            self.send(case, sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            try:
                while True:
                    self.check(reader.read().body)
            except (ConnectionClosed, ConnectionResetError, BrokenPipeError, FrameError):
                pass
            self.counts["closed"] += 1
        finally:
            sock.close()

    def run(self, ncases: int) -> None:
        done = 0
        assert self.reader is not None
        while done < ncases:
            batch: list[Case] = []
            special: Case | None = None
            while len(batch) < BATCH and done + len(batch) < ncases:
                c = self.gen.case()
                self.counts[c.kind.split(":")[0]] += 1
                if c.breaks or c.solo:
                    special = c
                    break
                batch.append(c)
            done += len(batch) + (special is not None)
            for c in batch:
                assert self.send(c), "the daemon dropped a well-behaved connection"
            # every well-framed case is answered exactly once, in any order
            for _ in batch:
                assert self.check(self.reader.read().body), "a request closed the main connection"
            if special is not None and special.breaks:
                self.side(special)
            elif special is not None:
                assert self.send(special)
                assert self.check(self.reader.read().body)
            if not self.own:
                self.connect()  # the fuzzer closed its own session: get a fresh one
        self.counts["cases"] += done

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        # the foreign session was never touched by the fuzzer: its bytes are intact
        self.other_sess.slot(0)[:] = bytes(SLOT)
        self.other_sess.read(3, "v", 0)
        assert bytes(self.other_sess.slot(0)) == b"\xa5" * SLOT
        self.other_sess.close()
        self.other.close()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def assert_well_behaved_client_works(d: DaemonProcess) -> None:
    with Client(d.socket_path) as c, c.open_session(GEOMETRY, channels=2) as s:
        for layer in range(GEOMETRY["layers"]):
            s.slot(1)[:] = random.Random(layer).randbytes(SLOT)
            s.write(layer, "k", 1)
        for layer in range(GEOMETRY["layers"]):
            s.slot(0)[:] = bytes(SLOT)
            s.read(layer, "k", 0)
            assert bytes(s.slot(0)) == random.Random(layer).randbytes(SLOT)


def run_fuzz(d: DaemonProcess, ncases: int, seed: int) -> dict[str, object]:
    """Fuzz a running daemon; returns the figures (cases, rate, reply codes)."""
    before_fds = fd_count(d.pid)
    f = Fuzzer(d.socket_path, seed)
    t0 = time.monotonic()
    try:
        f.run(ncases)
    finally:
        f.close()
    secs = time.monotonic() - t0
    assert d.proc is not None and d.proc.poll() is None, "bladed died under fuzzing:\n" + d.log()[-4000:]
    with Client(d.socket_path) as c:
        # every fuzz connection torn down (on its reader thread), one cut short before its accept too
        stats = wait_connections(c, 1, queued=True)
        assert stats["sessions"] == 0 and stats["extents"]["used_blocks"] == 0, stats
    assert_well_behaved_client_works(d)
    after_fds = fd_count(d.pid)
    assert after_fds <= before_fds + 2, f"descriptor leak: {before_fds} -> {after_fds}"
    assert "Traceback" not in d.log(), d.log()[-4000:]
    return {"cases": f.counts["cases"], "seconds": secs, "rate": f.counts["cases"] / secs,
            "connections": f.counts["connections"], "codes": dict(f.codes), "kinds": dict(f.counts)}


@contextlib.contextmanager
def fuzz_daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp, DaemonProcess(tmp, FUZZ_CONFIG).start() as d:
        yield d


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with fuzz_daemon() as d:
        yield d


@pytest.mark.slow
def test_100k_fuzz_cases_get_an_answer_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    out = run_fuzz(daemon, CI_CASES, seed=int(os.environ.get("BLADED_FUZZ_SEED", "7")))
    print(f"\nfuzz: {out['cases']} cases in {out['seconds']:.1f} s = {out['rate']:.0f}/s, "
          f"{out['connections']} connections; replies {out['codes']}")
    assert out["cases"] == CI_CASES
    codes = out["codes"]
    assert isinstance(codes, dict)
    # the generator reaches deep: real I/O succeeded, and the hostile values were refused for the right reasons
    for code in ("ok", "bad_request", "out_of_range", "no_such_session", "unknown_op", "bad_frame",
                 "handshake_required"):
        assert codes.get(code, 0) > 0, (code, codes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), ncases=st.integers(1, 200))
def test_hypothesis_seeded_fuzz_batches(daemon: DaemonProcess, seed: int, ncases: int) -> None:
    f = Fuzzer(daemon.socket_path, seed)
    try:
        f.run(ncases)
    finally:
        f.close()
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_foreign_session_ids_and_lba_like_fields_reach_nothing(daemon: DaemonProcess) -> None:
    """Valid frames naming another connection's session, or carrying raw-LBA fields, are refused or ignored."""
    with Client(daemon.socket_path) as a, Client(daemon.socket_path) as b, a.open_session(GEOMETRY, channels=1) as sa:
        sa.slot(0)[:] = b"\x5a" * SLOT
        sa.write(2, "k", 0)
        with b.open_session(GEOMETRY, channels=1) as sb:
            for op in ("read", "write", "close_session"):
                err = b.call_async(op, session=sa.id, layer=2, kind="k", channel=0).exception(10)
                assert err is not None and err.code is ErrorCode.NO_SUCH_SESSION, (op, err)
            # an LBA or tensor id is not part of the protocol: it cannot redirect a read to someone else's blocks
            mine = [x for x in a.sessions() if x["session"] == sa.id]
            assert mine and mine[0]["extent"] is not None
            r = b.call("read", session=sb.id, layer=2, kind="k", channel=0, slba=mine[0]["extent"]["start"],
                       lba=0, tensor_id=4)
            assert r["ok"] and bytes(sb.slot(0)) == bytes(SLOT)
        sa.slot(0)[:] = bytes(SLOT)
        sa.read(2, "k", 0)
        assert bytes(sa.slot(0)) == b"\x5a" * SLOT


def test_hostile_values_echoed_in_errors_cannot_blow_the_reply_past_the_frame_limit(daemon: DaemonProcess) -> None:
    """A near-limit op name or kind string is echoed in the error message: the reply must still fit a frame."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(daemon.socket_path)
    reader = FrameReader(sock)
    try:
        send_frame(sock, {"op": "hello", "id": 0, "protocol": PROTOCOL_VERSION})
        assert reader.read().body["ok"]
        huge = "z" * (MAX_FRAME_BYTES - 100)
        for i, body in enumerate([{"op": huge}, {"op": "read", "session": huge},
                                  {"op": "open_session", "mode": huge}]):
            send_frame(sock, {**body, "id": i + 1})
            reply = reader.read().body
            assert reply["id"] == i + 1 and reply["ok"] is False
            assert len(reply["error"]["message"]) < 4096
            assert "..." in reply["error"]["message"] or body["op"] == "open_session"
        send_frame(sock, {"op": "status", "id": 9})
        assert reader.read().body["ok"]
    finally:
        sock.close()


# -- every accepted open_session gets a reply that fits a frame -----------------------------------------
MAX_STAGING = FUZZ_CONFIG["io"]["max_staging_bytes"]
MAX_CHANNELS = FUZZ_CONFIG["io"]["max_channels"]


def wait_region_free(sock: socket.socket, reader: FrameReader, timeout: float = 30.0) -> int:
    """The region's size in bytes, once the connections of earlier tests (each answered, so accepted) are torn
    down: their sessions closed and extents freed, ``sock`` the daemon's only connection. Each check is a
    round trip on ``sock``, not a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        send_frame(sock, {"op": "status", "id": 8})
        status = reader.read().body
        if status["connections"] == 1:
            assert status["sessions"] == 0 and status["extents"]["used_blocks"] == 0, status
            return int(status["region"]["bytes"])
        assert time.monotonic() < deadline, (f"timed out after {timeout:g} s waiting for earlier connections to go; "
                                             f"seen: {status['connections']} connections, {status['sessions']} "
                                             "sessions")


@st.composite
def open_requests(draw: st.DrawFn) -> dict[str, object]:
    """open_session requests at and just past the accepted limits: up to MAX_LAYERS (+1) layers, one KPU up to
    io.max_staging_bytes (the largest batch or max_tokens a slot holds, or one past it), up to io.max_channels (+1)
    channels, every mode, checksums on or off."""
    layers = draw(st.sampled_from([1, 2, MAX_LAYERS - 1, MAX_LAYERS, MAX_LAYERS, MAX_LAYERS + 1])
                  | st.integers(1, MAX_LAYERS))
    dtype = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from([1, 3, 8, 32]))
    head_dim = draw(st.sampled_from([1, 7, 64, 128]))
    row = kv_heads * head_dim * dtype
    batch, max_tokens = draw(st.integers(1, 4)), draw(st.integers(1, 64))
    if row * batch * max_tokens > MAX_STAGING:
        batch = max_tokens = 1
    size = draw(st.sampled_from(["small", "max_batch", "max_tokens", "past_max"]))
    if size == "max_batch" or size == "past_max":
        batch = max(1, MAX_STAGING // (row * max_tokens)) + (size == "past_max")
    elif size == "max_tokens":
        max_tokens = max(1, MAX_STAGING // (row * batch))
    geometry = {"layers": layers, "batch": batch, "kv_heads": kv_heads, "head_dim": head_dim, "dtype_bytes": dtype,
                "max_tokens": max_tokens}
    return {"geometry": geometry, "channels": draw(st.integers(1, MAX_CHANNELS + 1)),
            "mode": draw(st.sampled_from(MODES)), "checksums": draw(st.booleans())}


def _tiny(layers: int, mode: str) -> dict[str, object]:
    geometry = {"layers": layers, "batch": 1, "kv_heads": 1, "head_dim": 1, "dtype_bytes": 1, "max_tokens": 1}
    return {"geometry": geometry, "channels": MAX_CHANNELS, "mode": mode, "checksums": True}


def _largest_kpu(mode: str) -> dict[str, object]:
    geometry = {"layers": 1, "batch": MAX_STAGING // 4096, "kv_heads": 1, "head_dim": 1024, "dtype_bytes": 4,
                "max_tokens": 1}
    return {"geometry": geometry, "channels": 1, "mode": mode, "checksums": False}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=open_requests())
@example(req=_tiny(MAX_LAYERS, "dualblade"))
@example(req=_tiny(MAX_LAYERS, "baseline"))
@example(req=_tiny(MAX_LAYERS, "cachepolicy"))
@example(req=_tiny(MAX_LAYERS, "direct"))
@example(req=_tiny(MAX_LAYERS + 1, "dualblade"))
@example(req=_largest_kpu("dualblade"))
def test_every_accepted_open_session_gets_a_well_formed_reply_that_fits_a_frame(
        daemon: DaemonProcess, req: dict[str, object]) -> None:
    geo = req["geometry"]
    assert isinstance(geo, dict) and isinstance(req["channels"], int)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(60)
    sock.connect(daemon.socket_path)
    reader = FrameReader(sock)  # refuses any frame over MAX_FRAME_BYTES: a reply that does not fit fails here
    try:
        send_frame(sock, {"op": "hello", "id": 0, "protocol": PROTOCOL_VERSION})
        hello = reader.read().body
        align, lba = hello["staging_align"], hello["lba_size"]
        region = wait_region_free(sock, reader)
        kpu_bytes = geo["batch"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"] * geo["max_tokens"]
        token_bytes = kpu_bytes // geo["max_tokens"]
        # the most the direct-path KPUs can take: every KPU direct, token rows padded to the LBA size
        direct_bytes = 2 * geo["layers"] * align_up(token_bytes, lba) * geo["max_tokens"]
        staging = req["channels"] * align_up(kpu_bytes, align)
        fd = staging_memfd(staging)
        try:
            send_frame(sock, {"op": "open_session", "id": 1, "staging_bytes": staging, **req}, [fd])
        finally:
            os.close(fd)
        reply = reader.read().body
        assert reply["id"] == 1 and len(encode(reply)) <= MAX_FRAME_BYTES
        within = geo["layers"] <= MAX_LAYERS and req["channels"] <= MAX_CHANNELS and staging <= MAX_STAGING
        event("ok" if reply["ok"] else reply["error"]["code"])
        event(f"{'at' if geo['layers'] == MAX_LAYERS else 'past' if geo['layers'] > MAX_LAYERS else 'below'} "
              f"MAX_LAYERS, {'ok' if reply['ok'] else 'refused'}")
        if not reply["ok"]:
            code, message = reply["error"]["code"], reply["error"]["message"]
            if geo["layers"] > MAX_LAYERS:
                assert (code, message) == ("bad_request", f"field 'geometry.layers' must be <= {MAX_LAYERS}, "
                                                          f"got {geo['layers']}")
            elif req["channels"] > MAX_CHANNELS:
                assert (code, message) == ("bad_request", f"field 'channels' must be <= {MAX_CHANNELS}, "
                                                          f"got {req['channels']}")
            elif staging > MAX_STAGING:
                assert code == "bad_request" and "io.max_staging_bytes" in message, reply
            else:
                # within every limit: only the region may be too small for the direct-path KPUs
                assert code == "no_space" and direct_bytes > region, reply
        else:
            assert within, reply
            plan, layout = reply["plan"], reply["layout"]
            assert isinstance(reply["session"], str) and plan["geometry"]["layers"] == geo["layers"]
            # what clients read (bladed.client.Session, BladedKV, the bench workload): one entry per KPU
            assert [(k["layer"], k["kind"], k["tensor_id"]) for k in plan["kpus"]] == [
                (t // 2, "kv"[t % 2], t) for t in range(2 * geo["layers"])]
            assert all(k["group"] in (1, 2) and k["path"] in ("pagecache", "direct") for k in plan["kpus"])
            assert sorted(plan["group1"] + plan["group2"]) == list(range(2 * geo["layers"]))
            assert (layout["channels"], layout["kpu_bytes"], layout["staging_bytes"]) == (
                req["channels"], kpu_bytes, staging)
            # the session works at the limit: its last KPU round-trips, then it closes
            last = {"session": reply["session"], "layer": geo["layers"] - 1, "kind": "v",
                    "channel": req["channels"] - 1}
            for i, op in enumerate(("write", "read", "close_session")):
                send_frame(sock, {"op": op, "id": 2 + i, **last})
                assert reader.read().body["ok"], op
        send_frame(sock, {"op": "status", "id": 9})
        assert reader.read().body["ok"]  # the connection is still usable
    finally:
        sock.close()
    assert daemon.proc is not None and daemon.proc.poll() is None


# -- binary I/O requests on a data connection -----------------------------------------------------------
U32 = st.one_of(st.sampled_from([0, 1, 7, 8, 9, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
U64 = st.one_of(st.sampled_from([0, TOKEN, SLOT - 1, SLOT, 2 * SLOT, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


@st.composite
def io_bodies(draw: st.DrawFn) -> bytes:
    """A binary I/O request body: mostly well laid out with hostile values, sometimes cut or padded."""
    n = draw(st.integers(0, 6))
    head = IO_REQUEST.pack(draw(st.integers(0, 2**64 - 1)), draw(st.sampled_from([n, n, n, 0, 5000, 65535])),
                           draw(st.sampled_from([0, 0, 0, 1, 0x8000])))
    ranges = b"".join(IO_RANGE.pack(draw(st.sampled_from([1, 2, 2, 0, 3, 255])), draw(U32), draw(U32), draw(U32),
                                    draw(U64)) for _ in range(n))
    body = head + ranges
    cut = draw(st.sampled_from([None, None, None, 0, 5, 13, len(body) - 1]))
    return (body[:cut] if cut is not None else body) + draw(st.sampled_from([b"", b"", b"\0", b"x" * 30]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(io_bodies(), min_size=1, max_size=12))
def test_every_binary_request_gets_a_well_formed_reply_and_the_channel_serves_on(daemon: DaemonProcess,
                                                                                  bodies: list[bytes]) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEOMETRY, channels=2, slot_bytes=2 * SLOT) as s:
        dc = s.channel(1)
        for body in bodies:
            dc._sock.sendall(HEADER.pack(MAGIC, IO_FORMAT, 0, len(body)) + body)
            fmt, raw = dc._stream.read()
            assert fmt == IO_FORMAT
            req_id, refused, text, results = decode_io_reply(raw)
            if len(body) >= IO_REQUEST.size:
                assert req_id == IO_REQUEST.unpack_from(body)[0]
            if refused is None:
                n = IO_REQUEST.unpack_from(body)[1]
                assert len(results) == n and all(r.error is None or r.message for r in results)
                event("served")
            else:
                assert refused in (ErrorCode.BAD_REQUEST, ErrorCode.OUT_OF_RANGE) and text, (refused, text)
                event(f"refused: {refused.value}")
        s.slot(1)[:SLOT] = b"\xa7" * SLOT
        s.write(3, "v", 1)
        s.slot(1)[:SLOT] = bytes(SLOT)
        assert s.read(3, "v", 1).nbytes == SLOT and bytes(s.slot(1)[:SLOT]) == b"\xa7" * SLOT
    assert daemon.proc is not None and daemon.proc.poll() is None
