"""The daemon's log, read from a real daemon process: every line ``key=value`` with a level, journald's
``<priority>`` prefix without a timestamp under systemd, one line per connection for a client that
sends garbage, budget drift at DEBUG and only when B_pc moves, and what ``log.level = "debug"`` adds.

Waits block on log lines (``DaemonProcess.wait_fields``) or on round trips to the daemon, with
deadlines, and wait for what follows their action: a line after a mark taken before it, a counter past
its value before it.  A line that must *not* appear is checked after a later line that the daemon
writes after it would have (:func:`unknown_op`): the log is one pipe, read in order.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from cgroup_util import ChildCgroup
from daemon_util import DaemonProcess, UnixHTTPConnection, env_with_repo, logfmt_fields, scrape, short_tmpdir
from test_protocol import Raw, error_code

from bladed.client import Client
from bladed.logfmt import render
from bladed.protocol import HEADER, JSON_FORMAT, MAGIC, PROTOCOL_VERSION, BadRequestError

GEOMETRY = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096
LEVELS = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}
BAD_REQUEST = "bad request; later ones on this connection are only counted (bad_requests)"
MiB = 1 << 20


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


class msg:
    """A predicate on parsed log lines: ``msg == text`` and every ``match`` field equal (its repr says so in a
    failed wait's message)."""

    def __init__(self, text: str, **match: str) -> None:
        self.text, self.match = text, match

    def __call__(self, f: dict[str, str]) -> bool:
        return f.get("msg") == self.text and all(f.get(k) == v for k, v in self.match.items())

    def __repr__(self) -> str:
        return f"msg={self.text!r}" + "".join(f" {k}={v}" for k, v in self.match.items())


def unknown_op(d: DaemonProcess) -> dict[str, str]:
    """A marker: an unknown op on a connection of its own, and its warning line (written after
    every line the daemon wrote before it answered)."""
    mark = d.mark()
    with Client(d.socket_path) as c, pytest.raises(BadRequestError, match="unknown op"):
        c.call("frobnicate")
    (line,) = d.wait_fields(msg(BAD_REQUEST, reason="unknown_op"), after=mark)
    return line


def bad_json(raw: Raw) -> str:
    body = b"{not json"
    raw.sock.sendall(HEADER.pack(MAGIC, JSON_FORMAT, 0, len(body)) + body)
    return error_code(raw.reader.read().body)


def budget_lines(d: DaemonProcess) -> list[dict[str, str]]:
    return [f for f in map(logfmt_fields, d.log().splitlines()) if f.get("msg", "").startswith("budget changed")]


def metric(path: str, name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
    return scrape(UnixHTTPConnection(path))[(name, labels)]


def wait_metric(path: str, name: str, labels: tuple[tuple[str, str], ...], at_least: float,
                timeout: float = 30.0) -> float:
    """Scrape until ``name`` reaches ``at_least`` (each scrape is a round trip to the daemon, not a sleep).

    After an action, ``at_least`` is the counter's value before the action plus what the action adds, so
    that it cannot already hold."""
    deadline = time.monotonic() + timeout
    while (v := metric(path, name, labels)) < at_least:
        assert time.monotonic() < deadline, f"{name}{dict(labels)} stayed at {v} (waiting for {at_least})"
    return v


def test_text_lines_are_key_value_with_a_timestamp_a_level_and_the_logger(tmp: str) -> None:
    with DaemonProcess(tmp, {"log": {"format": "text"}}).start() as d:
        with Client(d.socket_path) as c:
            c.status()
        unknown_op(d)
        term = d.mark()
        assert d.stop() == 0
        d.wait_line("event=daemon_stop", after=term)
    lines = d.log().splitlines()
    assert len(lines) >= 4
    now = datetime.datetime.now(datetime.UTC)
    for line in lines:
        f = logfmt_fields(line)
        assert render(f) == line, f"not only key=value fields: {line!r}"
        assert list(f)[:3] == ["ts", "level", "logger"], line
        ts = datetime.datetime.fromisoformat(f["ts"])
        assert f["ts"].endswith("Z") and abs((now - ts).total_seconds()) < 600, line
        assert f["level"] in ("info", "warning"), line          # log.level = info: no debug lines
        assert list(f)[3] in ("event", "msg"), line
    start = d.wait_event("daemon_start")                        # what the start itself does, once
    # the structured events keep their fields, right after event=
    assert list(start)[3:7] == ["event", "version", "pid", "backend"] and start["pid"] == str(d.pid)
    assert (start["level"], start["logger"]) == ("info", "bladed.events")
    stop = d.wait_fields(msg("SIGTERM received: draining and stopping"), after=term)[0]
    assert (stop["level"], stop["logger"]) == ("info", "bladed")


def test_journald_lines_carry_the_priority_and_no_timestamp(tmp: str) -> None:
    with DaemonProcess(tmp, env={"JOURNAL_STREAM": "8:1234"}).start() as d:      # log.format = auto
        marker = unknown_op(d)
        term = d.mark()
        assert d.stop() == 0
        d.wait_line("event=daemon_stop", after=term)
    assert marker["level"] == "warning"
    for line in d.log().splitlines():
        f = logfmt_fields(line)
        assert line == f"<{LEVELS[f['level']]}>{render(f)}", line
        assert "ts" not in f and list(f)[:2] == ["level", "logger"], line
    assert any(line.startswith("<4>level=warning logger=bladed.connection msg=") for line in d.log().splitlines())


def test_bad_json_twice_on_one_connection_is_one_line_with_the_peer(tmp: str) -> None:
    with DaemonProcess(tmp).start() as d, Client(d.socket_path) as c:
        raw = Raw(d.socket_path)
        assert bad_json(raw) == "bad_request" and bad_json(raw) == "bad_request"
        assert error_code(raw.call({"op": "frobnicate", "id": 1})) == "unknown_op"
        assert raw.call({"op": "status", "id": 2})["ok"]        # the connection survives all three
        marker = unknown_op(d)                                  # a second connection: a line of its own
        lines = d.wait_fields(msg(BAD_REQUEST), 2)              # all in: the marker's is the run's last
        assert len(lines) == 2 and lines[-1] == marker, lines
        first = lines[0]
        assert (first["level"], first["logger"], first["reason"]) == ("warning", "bladed.connection", "bad_request")
        assert (first["pid"], first["uid"]) == (str(os.getpid()), str(os.getuid()))
        assert first["error"].startswith("frame body is not valid JSON: ")
        # the rest were counted
        st = c.stats()
        assert (st["bad_requests"], st["bad_requests_by_code"]) == (4, {"bad_request": 2, "unknown_op": 2})
        raw.close()


def test_bad_frames_and_refused_handshakes_are_logged_with_the_peer(tmp: str) -> None:
    with DaemonProcess(tmp).start() as d:
        raw = Raw(d.socket_path, greet=False)
        raw.sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert error_code(raw.reader.read().body) == "bad_frame" and raw.closed()
        raw.close()
        old = Raw(d.socket_path, greet=False)
        assert error_code(old.call({"op": "hello", "id": 0, "protocol": PROTOCOL_VERSION + 1})) == \
            "incompatible_protocol"
        old.close()
        rude = Raw(d.socket_path, greet=False)
        assert error_code(rude.call({"op": "status", "id": 0})) == "handshake_required"
        rude.close()
        unknown_op(d)                                           # after it, every line of the run is in
        by_reason = {f["reason"]: f for f in d.wait_fields(msg(BAD_REQUEST), 4)}
        assert by_reason.keys() == {"bad_frame", "incompatible_protocol", "handshake_required", "unknown_op"}
        assert "bad frame magic" in by_reason["bad_frame"]["error"]
        assert f"client speaks protocol {PROTOCOL_VERSION + 1}" in by_reason["incompatible_protocol"]["error"]
        assert all(f["pid"] == str(os.getpid()) and f["level"] == "warning" for f in by_reason.values())


def test_debug_adds_connection_session_and_plan_lines_but_none_per_request(tmp: str) -> None:
    cfg = {"log": {"level": "debug"}, "budget": {"override": 2 * KPU}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        # the run's first connection from this process: nothing before it can have logged this line
        opened = d.wait_fields(msg("connection opened", pid=str(os.getpid())))[0]
        assert (opened["level"], opened["uid"]) == ("debug", str(os.getuid()))
        with c.open_session(GEOMETRY, channels=2) as s:
            plan = d.wait_fields(msg("session plan", session=s.id))[0]
            assert (plan["mode"], plan["pagecache_budget_bytes"], plan["granted"]) == \
                ("dualblade", str(2 * KPU), str(2 * KPU))
            assert (plan["group1"], plan["group2"], plan["group1_layers"]) == ("k0,v0", "k1,v1", "1")
            s.write(0, "k", 0)
            s.write(1, "v", 1)                                   # one data connection per channel
            attached = d.wait_fields(msg("data connection attached", session=s.id), 2)
            assert {a["channel"] for a in attached} == {"0", "1"}
            hello = d.mark()
            with pytest.raises(BadRequestError, match="hello was already exchanged"):
                c.call("hello", protocol=PROTOCOL_VERSION)      # a line of its own: the mark before the I/O
            d.wait_fields(msg(BAD_REQUEST), after=hello)
            before = len(d.wait_fields(msg(BAD_REQUEST)))       # the run's only one
            io = d.mark()
            for i in range(40):
                s.write(i % 2, "kv"[i % 2], i % 2)
                s.read(i % 2, "kv"[i % 2], i % 2)
            # a refused control request (not a protocol error) is a DEBUG line, and the mark after the I/O
            with pytest.raises(Exception, match="no session"):
                c.call("close_session", session="nope")
            refused = d.wait_fields(msg("request refused", op="close_session"), after=io)[0]
            assert (refused["level"], refused["reason"]) == ("debug", "no_such_session")
            lines = d.lines_after(io)
            between = lines[:lines.index(next(ln for ln in lines if "request refused" in ln))]
            assert between == [], f"lines logged during 80 I/O requests: {between}"
            assert before == 1
            close = d.mark()
        closed = d.wait_fields(msg("connection closed", kind="data"), 2, after=close)
        # each: hello and attach, then its share of the 82 I/O requests
        assert sum(int(f["requests"]) for f in closed) == 2 * 2 + 82 and {f["refused"] for f in closed} == {"0"}
    # and at info, none of these
    with DaemonProcess(tmp, {"budget": {"override": 2 * KPU}}).start() as d, Client(d.socket_path) as c:
        with c.open_session(GEOMETRY, channels=2) as s:
            s.write(0, "k", 0)
        unknown_op(d)
        assert not [ln for ln in d.log().splitlines() if logfmt_fields(ln).get("level") == "debug"]


def test_periodic_samples_that_leave_b_pc_alone_log_nothing(tmp: str) -> None:
    cfg = {"budget": {"override": 64 * MiB, "interval_s": 0.05}, "log": {"level": "debug"},
           "metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
    with DaemonProcess(tmp, cfg).start() as d:
        path = os.path.join(tmp, "metrics.sock")
        wait_metric(path, "bladed_budget_samples_total", (("reason", "periodic"),), 10)
        unknown_op(d)
        assert budget_lines(d) == []
        assert metric(path, "bladed_pagecache_budget_changes_total") == 0


@pytest.mark.root
def test_budget_moves_found_by_periodic_samples_are_debug_lines(tmp: str) -> None:
    """B_pc follows a real memory cgroup's limit: a move is a DEBUG line (none at INFO), and the
    samples that find it where it was log nothing, even at DEBUG."""
    def periodic(d: DaemonProcess) -> list[dict[str, str]]:
        return [f for f in budget_lines(d) if f["msg"] == "budget changed (periodic)"]

    with ChildCgroup(256 * MiB) as cg:
        # kernel_overhead, headroom and absorb_rate 0: B_pc is the limit itself while nothing is charged to cg
        cfg = {"budget": {"cgroup": cg.path, "interval_s": 0.05, "kernel_overhead": 0.0, "headroom": 0.0,
                          "absorb_rate": 0},
               "metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
        with DaemonProcess(tmp, cfg).start() as d:
            path = os.path.join(tmp, "metrics.sock")
            assert metric(path, "bladed_pagecache_budget_bytes") == 256 * MiB   # nothing charged to cg
            changes = metric(path, "bladed_pagecache_budget_changes_total")
            cg.set_limit(512 * MiB)
            wait_metric(path, "bladed_pagecache_budget_changes_total", (), changes + 1)
            unknown_op(d)
            assert periodic(d) == []                                          # log.level = info

            d.config["log"] = {"level": "debug"}
            d.write_config()
            hup = d.signal(signal.SIGHUP)
            assert d.wait_event("reload", after=hup)["applied"] == "log.level"
            shrink = d.mark()
            cg.set_limit(256 * MiB)
            (moved,) = d.wait_fields(msg("budget applied to live sessions", pagecache_budget_bytes=str(256 * MiB)),
                                     after=shrink)
            assert moved["grants"] == "none"                                  # no session to re-plan
            (line,) = [f for f in budget_lines(d) if f["pagecache_budget_bytes"] == str(256 * MiB)]
            if line["msg"] == "budget changed (periodic)":
                assert line["level"] == "debug"
            else:   # a memory event's sample found it first: that one is news, at INFO
                assert line["msg"] in ("budget changed (pressure)", "budget changed (threshold)"), line
                assert line["level"] == "info"
            assert (line["previous_pagecache_budget_bytes"], line["memory_limit_bytes"]) == \
                (str(512 * MiB), str(256 * MiB))
            assert line["cgroup"].endswith(cg.path)
            samples = metric(path, "bladed_budget_samples_total", (("reason", "periodic"),))
            wait_metric(path, "bladed_budget_samples_total", (("reason", "periodic"),), samples + 10)
            unknown_op(d)
            # ten more samples found B_pc where it was: not a line more, at any level
            assert budget_lines(d)[-1] == line and periodic(d) in ([], [line])
            assert metric(path, "bladed_pagecache_budget_changes_total") == 2
        assert d.proc is not None and d.proc.returncode == 0


def test_connection_opened_and_closed_are_debug_lines_for_every_peer(tmp: str) -> None:
    """A peer that connects and goes without a word: opened and closed at DEBUG, nothing at INFO."""
    with DaemonProcess(tmp, {"log": {"level": "debug"}}).start() as d:
        peer = d.mark()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket_path)
        s.close()
        closed = d.wait_fields(msg("connection closed", pid=str(os.getpid())), after=peer)[0]
        assert (closed["level"], closed["reason"], closed["kind"], closed["requests"]) == \
            ("debug", "client_gone", "control", "0")


REPORT = """
import sys
from bladed.config import load_config
from bladed.server.daemon.systemd import report_error, setup_logging
if sys.argv[1] == "configured":
    setup_logging(load_config(None))
report_error('device.path: "/dev/nvme9n1" does not exist; fix device.path')
"""


JOURNAL_ERROR = r'<3>level=error logger=bladed msg="device.path: \"/dev/nvme9n1\" does not exist; fix device.path"'


@pytest.mark.parametrize("when,journal,want", [
    ("early", False, 'bladed: device.path: "/dev/nvme9n1" does not exist; fix device.path'),
    ("early", True, JOURNAL_ERROR),
    ("configured", True, JOURNAL_ERROR),
    ("configured", False, 'bladed: device.path: "/dev/nvme9n1" does not exist; fix device.path'),
])
def test_an_error_that_stops_bladed_is_one_line(when: str, journal: bool, want: str) -> None:
    """``report_error``: one line on stderr, in journald's form with the error priority under systemd
    whether or not logging is set up yet, else a plain ``bladed: ...`` line for the terminal."""
    env = env_with_repo()
    env.pop("JOURNAL_STREAM", None)
    if journal:
        env["JOURNAL_STREAM"] = "8:1234"
    r = subprocess.run([sys.executable, "-c", REPORT, when], env=env, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", want + "\n")
