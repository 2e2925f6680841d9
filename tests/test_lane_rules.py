"""The C lane's request checks are a pre-filter of the Python rulebook: they pass exactly what it accepts.

A binary I/O request is checked twice on its way in: by the lane, in C, before it takes the channel lock
(``lane_checks`` in ``cffi_build/bladed_lane.c``, exposed as ``bd_lane_check``), and, for every request
the lane does not take, by the Python rulebook (``protocol.decode_io_request``, then
``bladed.server.sessions.rules.check_ranges``), which serves it or refuses it with its error code and
message.  The lane refuses nothing itself: its "no" hands the frame to Python untouched.  So the relation
that must hold is

* the lane takes a request  <=>  the rulebook accepts it (and then with the same number of ranges);

one way round, the lane would serve a request the protocol refuses; the other, it would send a request it
could serve to the slow path.  The same generated requests, good and bad (wrong sizes, bad ops, tensors
outside the session, token ranges outside the KPU and u32 overflow, slot offsets outside the slot, a KPU
twice with its tokens apart or overlapping, overlapping slot spans, too many ranges), go through both here,
and then through a real daemon, where the reply on the wire must be the rulebook's verdict: served by the
lane (its counter moves) when accepted, else refused with the rulebook's error code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from daemon_util import DaemonProcess, short_tmpdir
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from bladed import _uring
from bladed.client import Client
from bladed.protocol import (
    HEADER,
    IO_FORMAT,
    IO_RANGE,
    IO_REQUEST,
    MAGIC,
    MAX_RANGES,
    MIRROR,
    ErrorCode,
    RequestError,
    decode_io_reply,
    decode_io_request,
)
from bladed.residency.geometry import Geometry
from bladed.server.sessions.rules import check_ranges

U32 = (1 << 32) - 1


@dataclass(frozen=True)
class Case:
    """One request body and the session it is checked against."""

    geometry: Geometry
    slot_bytes: int
    limit: int           # io.max_outstanding
    body: bytes
    mutation: str


def geometry(layers: int, token_bytes: int, max_tokens: int) -> Geometry:
    return Geometry(layers=layers, batch=1, kv_heads=1, head_dim=token_bytes, dtype_bytes=1, max_tokens=max_tokens)


def rulebook(case: Case) -> int | ErrorCode:
    """The Python verdict: the number of ranges accepted, or the error code of the refusal."""
    try:
        _, ranges = decode_io_request(case.body)
        return len(check_ranges(case.geometry, case.slot_bytes, ranges, case.limit))
    except RequestError as e:
        return e.code


class CLane:
    """A ``struct bd_lane`` set up as ``bladed.server.wire.lane.Lane`` sets it up, for its checks alone."""

    def __init__(self, case: Case) -> None:
        ffi = _uring.ffi
        g = case.geometry
        limit = max(1, min(case.limit, MAX_RANGES))         # as Lane does
        self.scratch = ffi.new("uint64_t[]", 2 * limit)
        self.c = ffi.new("struct bd_lane *")
        self.c.ngates = 2 * g.layers                        # KPUGates(2 * layers)
        self.c.token_bytes = g.token_bytes
        self.c.max_tokens = g.max_tokens
        self.c.limit = limit
        self.c.slot_bytes = case.slot_bytes
        self.c.scratch = self.scratch

    def check(self, body: bytes) -> int:
        return int(_uring.lib.bd_lane_check(self.c, _uring.ffi.from_buffer("uint8_t[]", body), len(body)))


MUTATIONS = ("none", "none", "op", "tensor", "twice", "tokens", "slot", "overlap", "mirror", "random",
             "nranges", "flags", "cut", "pad")


@st.composite
def cases(draw: st.DrawFn, fixed: tuple[Geometry, int, int] | None = None) -> Case:
    """A request that the rulebook accepts (ranges on distinct KPUs, back to back in the slot), then at most one
    thing made wrong about it: a field of one range, or the body's head or length."""
    if fixed is None:
        g = geometry(draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 8, 4096])), draw(st.integers(1, 12)))
        slot_bytes = max(1, g.kpu_bytes * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, -1, 1,
                                                                                           g.token_bytes])))
        limit = draw(st.integers(1, 6))
    else:
        g, slot_bytes, limit = fixed
    tb, max_tokens, ntensors = g.token_bytes, g.max_tokens, 2 * g.layers
    n = draw(st.integers(1, min(limit + 1, ntensors)))       # one past io.max_outstanding at times
    tids = draw(st.permutations(range(ntensors)))[:n]
    ranges: list[list[int]] = []
    at = 0
    for tid in tids:
        t0 = draw(st.integers(0, max_tokens - 1))
        nt = draw(st.integers(1, max_tokens - t0))
        room = at + nt * tb <= slot_bytes
        so = MIRROR if n == 1 and draw(st.booleans()) else at if room else 0
        ranges.append([draw(st.sampled_from([1, 2])), tid, t0, nt, so])
        at += nt * tb
    mutation = draw(st.sampled_from(MUTATIONS))
    i = draw(st.integers(0, n - 1))
    r = ranges[i]
    if mutation == "op":
        r[0] = draw(st.sampled_from([0, 3, 255]))
    elif mutation == "tensor":
        r[1] = draw(st.sampled_from([ntensors, ntensors + 1, 1 << 31, U32]))
    elif mutation == "twice" and n > 1:
        r[1] = ranges[draw(st.sampled_from([j for j in range(n) if j != i]))][1]
    elif mutation == "tokens":
        r[2], r[3] = draw(st.sampled_from([(0, 0), (max_tokens, 1), (max_tokens - 1, 2), (U32, 1), (1, U32),
                                           (U32, U32), (0, max_tokens + 1)]))
    elif mutation == "slot":
        r[4] = draw(st.sampled_from([slot_bytes, max(0, slot_bytes - r[3] * tb + 1), slot_bytes - 1, 1 << 44,
                                     1 << 63, MIRROR - 1]))
    elif mutation == "overlap" and n > 1:
        other = ranges[draw(st.sampled_from([j for j in range(n) if j != i]))]
        r[4] = other[4] if other[4] != MIRROR else 0
        r[4] += draw(st.sampled_from([0, 0, 1, tb - 1 if tb > 1 else 0]))
    elif mutation == "mirror":
        r[4] = MIRROR
    elif mutation == "random":
        r[:] = [draw(st.sampled_from([0, 1, 2, 3])), draw(st.integers(0, U32)), draw(st.integers(0, U32)),
                draw(st.integers(0, U32)), draw(st.one_of(st.just(MIRROR), st.integers(0, MIRROR)))]
    nranges, flags = n, 0
    if mutation == "nranges":
        nranges = draw(st.sampled_from([0, n - 1, n + 1, MAX_RANGES + 1, 65535]))
    elif mutation == "flags":
        flags = draw(st.sampled_from([1, 0x8000]))
    body = IO_REQUEST.pack(draw(st.integers(0, (1 << 64) - 1)), nranges, flags) + \
        b"".join(IO_RANGE.pack(*x) for x in ranges)
    if mutation == "cut":
        body = body[:draw(st.integers(0, len(body) - 1))]
    elif mutation == "pad":
        body += bytes(draw(st.sampled_from([1, IO_RANGE.size - 1, IO_RANGE.size])))
    return Case(g, slot_bytes, limit, body, mutation)


def case_of(mutation: str, ranges: list[tuple[int, int, int, int, int]], *, head: tuple[int, int] | None = None,
            body_tail: bytes = b"", layers: int = 2, tb: int = 8, max_tokens: int = 4, slot_tokens: int = 8,
            limit: int = 4) -> Case:
    """A hand-made case: 2 layers of 4 tokens of 8 bytes, a slot of 8 tokens' bytes, 4 ranges a request."""
    nranges, flags = head if head is not None else (len(ranges), 0)
    body = IO_REQUEST.pack(7, nranges, flags) + b"".join(IO_RANGE.pack(*r) for r in ranges) + body_tail
    return Case(geometry(layers, tb, max_tokens), slot_tokens * tb, limit, body, mutation)


#: one request per rule, with the code the rulebook refuses it with (None: accepted)
TABLE = [
    ("accepted, mirrored", case_of("none", [(1, 3, 0, 4, MIRROR)]), None),
    ("accepted, batch", case_of("none", [(1, 0, 0, 4, 0), (2, 3, 2, 2, 32)]), None),
    ("accepted, slot to the last byte", case_of("none", [(2, 1, 0, 4, 32)]), None),
    ("short head", Case(geometry(2, 8, 4), 64, 4, bytes(IO_REQUEST.size - 1), "cut"), ErrorCode.BAD_REQUEST),
    ("flags", case_of("flags", [(1, 0, 0, 1, 0)], head=(1, 1)), ErrorCode.BAD_REQUEST),
    ("no ranges", case_of("nranges", [], head=(0, 0)), ErrorCode.BAD_REQUEST),
    ("body longer than its ranges", case_of("pad", [(1, 0, 0, 1, 0)], body_tail=b"\0"), ErrorCode.BAD_REQUEST),
    ("more ranges than MAX_RANGES", case_of("nranges", [(1, 0, 0, 1, 0)], head=(MAX_RANGES + 1, 0)),
     ErrorCode.BAD_REQUEST),
    ("bad op", case_of("op", [(3, 0, 0, 1, 0)]), ErrorCode.BAD_REQUEST),
    ("more ranges than io.max_outstanding", case_of("none", [(1, t, 0, 1, 8 * t) for t in range(4)], limit=3),
     ErrorCode.BAD_REQUEST),
    ("tensor outside the session", case_of("tensor", [(1, 4, 0, 1, 0)]), ErrorCode.OUT_OF_RANGE),
    ("a KPU twice, its tokens apart", case_of("twice", [(1, 1, 0, 1, 0), (1, 1, 2, 2, 8)]), None),
    ("a KPU twice, a read and a write", case_of("twice", [(2, 1, 3, 1, 0), (1, 1, 0, 3, 8)]), None),
    ("a KPU twice, its tokens overlapping", case_of("twice", [(1, 1, 0, 2, 0), (1, 1, 1, 1, 16)]),
     ErrorCode.BAD_REQUEST),
    ("a KPU's ranges overlap past a third", case_of("twice", [(1, 1, 0, 4, 0), (1, 1, 1, 1, 32), (1, 1, 3, 1, 48)],
                                                    slot_tokens=8), ErrorCode.BAD_REQUEST),
    ("no tokens", case_of("tokens", [(1, 0, 0, 0, 0)]), ErrorCode.OUT_OF_RANGE),
    ("past the KPU", case_of("tokens", [(1, 0, 3, 2, 0)]), ErrorCode.OUT_OF_RANGE),
    ("u32 overflow of the token range", case_of("tokens", [(1, 0, U32, 2, 0)]), ErrorCode.OUT_OF_RANGE),
    ("slot offset past the slot", case_of("slot", [(1, 0, 0, 1, 64)]), ErrorCode.OUT_OF_RANGE),
    ("range ends past the slot", case_of("slot", [(1, 0, 0, 2, 57)]), ErrorCode.OUT_OF_RANGE),
    ("slot offset near 2^64", case_of("slot", [(1, 0, 0, 1, MIRROR - 1)]), ErrorCode.OUT_OF_RANGE),
    ("mirror past a small slot", case_of("mirror", [(1, 0, 2, 2, MIRROR)], slot_tokens=3), ErrorCode.OUT_OF_RANGE),
    ("overlapping slot spans", case_of("overlap", [(1, 0, 0, 2, 0), (1, 1, 0, 2, 15)]), ErrorCode.BAD_REQUEST),
    ("mirrored ranges of two KPUs overlap", case_of("overlap", [(1, 0, 0, 2, MIRROR), (2, 1, 1, 2, MIRROR)]),
     ErrorCode.BAD_REQUEST),
]


@pytest.mark.parametrize(("case", "code"), [pytest.param(c, code, id=name) for name, c, code in TABLE])
def test_each_rule_one_request(case: Case, code: ErrorCode | None) -> None:
    """Every rule, once by hand: the rulebook's code, and the lane takes exactly the accepted ones."""
    verdict = rulebook(case)
    if code is None:
        assert isinstance(verdict, int) and not isinstance(verdict, ErrorCode), verdict
        assert CLane(case).check(case.body) == verdict
    else:
        assert verdict == code
        assert CLane(case).check(case.body) == 0


@settings(max_examples=2000, deadline=None)
@given(case=cases())
@example(case=TABLE[1][1])
@example(case=TABLE[-1][1])
def test_the_lane_takes_exactly_what_the_rulebook_accepts(case: Case) -> None:
    verdict = rulebook(case)
    event(f"{case.mutation}: {verdict.value if isinstance(verdict, ErrorCode) else 'accepted'}")
    taken = CLane(case).check(case.body)
    if isinstance(verdict, ErrorCode):
        assert taken == 0, f"the lane takes a request the rulebook refuses with {verdict.value}"
    else:
        assert taken == verdict, "the lane sends a request the rulebook accepts to Python"


# -- through a real daemon --------------------------------------------------------------------------------
#: 4 layers of 8 tokens of 4 KiB rows: all page-cache KPUs; 4 ranges a request; a slot of 4 KPUs
GEO = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
LIMIT = 4


@dataclass
class Live:
    client: Client
    session: Any
    fixed: tuple[Geometry, int, int]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    g = Geometry(**GEO)
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(short_tmpdir())
        dp = stack.enter_context(DaemonProcess(d, {"budget": {"override": 64 * g.kpu_bytes},
                                                   "io": {"max_outstanding": LIMIT}}).start())
        c = stack.enter_context(Client(dp.socket_path))
        s = stack.enter_context(c.open_session(GEO, channels=1, slot_bytes=4 * g.kpu_bytes))
        assert {k["path"] for k in s.plan["kpus"]} == {"pagecache"}
        for layer in range(g.layers):          # every KPU's file made: every gate opens
            for kind in "kv":
                s.write(layer, kind, 0)
        yield Live(c, s, (g, s.slot_bytes, LIMIT))


def lane_requests(c: Client) -> int:
    (row,) = c.sessions()
    return int(row["lane_requests"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_on_the_wire_the_reply_is_the_rulebook_s_verdict(live: Live, data: st.DataObject) -> None:
    """Accepted: served by the lane (its counter moves), every range ok.  Refused: the rulebook's code."""
    case = data.draw(cases(live.fixed))
    verdict = rulebook(case)
    dc = live.session.channel(0)
    before = lane_requests(live.client)
    dc._sock.sendall(HEADER.pack(MAGIC, IO_FORMAT, 0, len(case.body)) + case.body)
    fmt, raw = dc._stream.read()
    assert fmt == IO_FORMAT
    _, refused, message, results = decode_io_reply(raw)
    served_by_lane = lane_requests(live.client) - before
    event(f"{case.mutation}: {refused.value if refused else 'served'}")
    if isinstance(verdict, ErrorCode):
        assert (refused, served_by_lane) == (verdict, 0), message
    else:
        assert refused is None and served_by_lane == 1, message
        assert len(results) == verdict and all(r.ok and r.path == "pagecache" for r in results)
