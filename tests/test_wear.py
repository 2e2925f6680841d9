"""Wear: what bladed writes to its device, counted per cause and per session; the wear ledger that keeps it
across restarts and UTC days; the write budget (``io.write_budget``) that refuses new direct-path spills;
the kernel's count of a block device's writes; the SMART log's parsing (docs/operations.md, "Wear").

The ledger tests drive :class:`bladed.server.wear.WearLedger` with counters and a clock of their own; the
daemon tests run a real daemon on the file store.  Nothing sleeps: the daemon tests wait on its events.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import mmap
import os
import re
import signal
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from daemon_util import DaemonProcess, UnixHTTPConnection, scrape, short_tmpdir

from bladed.cli.bladectl import cli
from bladed.client import Client, PrefixKey, WriteBudgetExhaustedError
from bladed.config import format_size
from bladed.io import diskstats, smart
from bladed.io.diskstats import BlockStat, block_stat_of
from bladed.io.smart import DATA_UNIT_BYTES, SmartUnavailable, parse_smart_log, read_smart_log
from bladed.protocol import ErrorCode, RequestError
from bladed.server.wear import KEEP_DAYS, LEDGER_NAME, SMART_FIELDS, WearLedger, day_end

#: token = 2*8*128*2 = 4096 bytes: every row is whole LBAs; 4 layers -> 8 KPUs of 32 tokens
ALIGNED = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 32}
KPU = 32 * 4096
#: token = 768 bytes: rows packed on the extent, 16 in 3 LBAs
PACKED = {"layers": 2, "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "max_tokens": 64}
ROW = 768
LBA = 4096
DAY = 86400.0
CAUSES = ("requests", "demotion", "extent_move", "prefix")


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


class Counters:
    """What a daemon's counters say since it started: set by the test, pulled by the ledger."""

    def __init__(self) -> None:
        self.direct: dict[str, int] = {}
        self.device: dict[str, int] = {}

    def __call__(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.direct), dict(self.device)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def utc(*args: int) -> float:
    return datetime.datetime(*args, tzinfo=datetime.UTC).timestamp()


# -- the ledger ---------------------------------------------------------------------------------------
def test_the_ledger_survives_restarts_and_a_crash_loses_only_what_was_not_flushed(tmp_path) -> None:
    path = str(tmp_path / LEDGER_NAME)
    clock = Clock(utc(2026, 11, 28, 10))
    run1 = Counters()
    a = WearLedger(path, run1, clock)
    run1.direct = {"requests": 1000, "demotion": 300}
    run1.device = {"store": 5000}
    assert a.today_direct_bytes() == 1300
    assert a.flush()
    run1.direct["requests"] = 1700                  # counted, never flushed: the daemon dies here

    run2 = Counters()                               # the next daemon's counters start at 0 again
    b = WearLedger(path, run2, clock)
    t = b.totals()
    assert t["today"] == {"direct": {"requests": 1000, "demotion": 300}, "device": {"store": 5000}}
    assert t["total"] == t["today"]
    run2.direct = {"requests": 50, "prefix": 7}
    assert b.today_direct_bytes() == 1357
    b.flush()
    c = WearLedger(path, Counters(), clock).totals()
    assert c["total"]["direct"] == {"requests": 1050, "demotion": 300, "prefix": 7}
    assert c["installed"] == utc(2026, 11, 28, 10)
    # the file is whole JSON, mode 0600, and no temporary file is left behind
    with open(path) as f:
        assert json.load(f)["version"] == 1
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == [LEDGER_NAME]


def test_the_day_rolls_over_at_midnight_utc(tmp_path) -> None:
    clock = Clock(utc(2026, 11, 28, 23, 59, 50))
    n = Counters()
    led = WearLedger(str(tmp_path / LEDGER_NAME), n, clock)
    n.direct = {"requests": 100}
    assert led.today_direct_bytes() == 100
    assert day_end(clock.t) == utc(2026, 11, 29)
    clock.t = utc(2026, 11, 29, 0, 0, 10)
    assert led.today_direct_bytes() == 0            # a new day: nothing written in it yet
    n.direct = {"requests": 150}
    r = led.report(None, None, 0)
    assert (r["day"], r["today"]["direct_bytes"], r["since_install"]["direct_bytes"]) == ("2026-11-29", 50, 150)
    assert r["days"] == [{"day": "2026-11-28", "direct_bytes": 100, "direct": {"requests": 100}, "device": {}}]
    # a restart two days later rolls the day it finds, and only the last KEEP_DAYS past days are kept
    led.flush()
    for d in range(KEEP_DAYS + 3):
        clock.t = utc(2026, 12, 1) + d * DAY
        WearLedger(str(tmp_path / LEDGER_NAME), Counters(), clock).flush()
    days = WearLedger(str(tmp_path / LEDGER_NAME), Counters(), clock).report(None, None, 0)["days"]
    assert len(days) == KEEP_DAYS and days[-1]["day"] == "2027-01-01"


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"version": 1, "installed": "x"}', b"[1, 2]",
                                     b'{"version": 99}'])
def test_a_corrupt_ledger_is_kept_aside_with_one_warning_and_a_fresh_one_starts(
        tmp_path, caplog: pytest.LogCaptureFixture, content: bytes) -> None:
    path = tmp_path / LEDGER_NAME
    path.write_bytes(content)
    n = Counters()
    with caplog.at_level(logging.INFO, logger="bladed.wear"):
        led = WearLedger(str(path), n, Clock(utc(2026, 11, 28)))
    lines = [r for r in caplog.records if r.name == "bladed.wear"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    assert str(path) in lines[0].getMessage() and "starting a fresh one" in lines[0].getMessage()
    assert (tmp_path / f"{LEDGER_NAME}.corrupt").read_bytes() == content
    n.direct = {"requests": 42}
    assert led.flush() and led.totals()["total"]["direct"] == {"requests": 42}
    assert json.loads(path.read_text())["total"]["direct"] == {"requests": 42}


def test_a_missing_ledger_starts_fresh_with_one_info_line(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="bladed.wear"):
        led = WearLedger(str(tmp_path / LEDGER_NAME), Counters(), Clock(utc(2026, 11, 28)))
    assert [r.levelno for r in caplog.records if r.name == "bladed.wear"] == [logging.INFO]
    assert led.totals()["total"] == {"direct": {}, "device": {}}
    assert led.flush() and (tmp_path / LEDGER_NAME).exists()


def test_the_write_budget_refuses_once_today_reaches_it(tmp_path) -> None:
    clock = Clock(utc(2026, 11, 28, 16, 47, 30))
    n = Counters()
    led = WearLedger(str(tmp_path / LEDGER_NAME), n, clock)
    led.check_spill("session", "anything", 0)       # no budget: never refused
    n.direct = {"requests": 1 << 20, "prefix": (1 << 20) - 1}
    led.check_spill("session", "a session", 2 << 20)
    n.direct["prefix"] += 1
    with pytest.raises(RequestError) as e:
        led.check_spill("demotion", "a live demotion of k1", 2 << 20)
    assert e.value.code is ErrorCode.WRITE_BUDGET_EXHAUSTED
    msg = e.value.message
    assert "\n" not in msg and msg.startswith("a live demotion of k1 refused: ")
    assert "io.write_budget allows 2.0 MiB a day" in msg and "has written 2.0 MiB to the device today" in msg
    assert "rolls over at 00:00 UTC, in 7 h 12 min" in msg
    assert led.refusals == {"session": 0, "demotion": 1, "prefix": 0}
    assert led.report(None, None, 2 << 20)["write_budget"] == {
        "bytes": 2 << 20, "spent_bytes": 2 << 20, "left_bytes": 0, "exhausted": True, "refusals": led.refusals}
    clock.t = utc(2026, 11, 29, 0, 0, 1)            # a new UTC day: the budget starts again
    led.check_spill("session", "a session", 2 << 20)


def smart_reading(duw: int, pct: int, hours: int) -> dict[str, int]:
    return dict.fromkeys(SMART_FIELDS, 0) | {"data_units_written": duw, "percentage_used": pct,
                                             "power_on_hours": hours}


def test_smart_readings_give_the_trend_and_the_days_left(tmp_path) -> None:
    t0 = utc(2026, 11, 1)
    clock = Clock(t0)
    led = WearLedger(str(tmp_path / LEDGER_NAME), Counters(), clock)
    assert led.record_smart(smart_reading(1_000_000, 3, 5000), "QEMU nvmevm0")
    clock.t = t0 + 1800
    assert not led.record_smart(smart_reading(1_000_100, 3, 5000), "QEMU nvmevm0")   # under an hour: not kept
    # ten days at 2,000,000 data units (1.024 TB) a day and one percentage point of life
    clock.t = t0 + 10 * DAY
    assert led.record_smart(smart_reading(21_000_000, 4, 5240), "QEMU nvmevm0")
    now = smart_reading(21_000_000, 4, 5240)
    endurance = (600 * 10**12, "device.endurance_tbw")
    r = led.report(now, endurance, 0)
    assert r["smart_history"] == {"readings": 2, "since": t0, "drive": "QEMU nvmevm0"}
    per_day = 2_000_000 * DATA_UNIT_BYTES
    assert r["trend"]["data_written_bytes_per_day"] == pytest.approx(per_day)
    assert r["trend"]["percentage_used_per_day"] == pytest.approx(0.1)
    e = r["endurance"]
    assert (e["bytes"], e["source"], e["rate_basis"]) == (600 * 10**12, "device.endurance_tbw", "smart_trend")
    assert e["written_bytes"] == 21_000_000 * DATA_UNIT_BYTES
    assert e["days_left"] == pytest.approx((600e12 - 21_000_000 * DATA_UNIT_BYTES) / per_day)
    assert e["days_left_by_percentage_used"] == pytest.approx(96 / 0.1)
    # one reading only: the drive's lifetime average (bytes written over power-on hours) is the rate
    fresh = WearLedger(str(tmp_path / "other.json"), Counters(), clock)
    e1 = fresh.report(now, endurance, 0)["endurance"]
    assert e1["rate_basis"] == "lifetime_average"
    assert e1["rate_bytes_per_day"] == pytest.approx(21_000_000 * DATA_UNIT_BYTES / 5240 * 24)
    # without a rating, or without the drive's count, days left is unknown and says why
    assert "device.endurance_tbw" in led.report(now, None, 0)["endurance"]["why"]
    no_smart = led.report(None, endurance, 0)["endurance"]
    assert no_smart["days_left"] is None and "no SMART log" in no_smart["why"]
    # another drive starts the history again; readings older than KEEP_DAYS go
    clock.t = t0 + 11 * DAY
    assert led.record_smart(smart_reading(5, 0, 1), "Other serial2")
    assert led.report(None, None, 0)["smart_history"]["readings"] == 1
    for d in range(KEEP_DAYS + 2):
        clock.t = t0 + (12 + d) * DAY
        led.record_smart(smart_reading(6 + d, 0, 1), "Other serial2")
    assert led.report(None, None, 0)["smart_history"]["since"] >= clock.t - KEEP_DAYS * DAY


# -- the drive's and the kernel's figures ----------------------------------------------------------------
def test_the_smart_log_page_is_parsed_field_by_field() -> None:
    page = bytearray(512)
    page[0] = 0x04
    struct.pack_into("<H", page, 1, 318)
    page[3:6] = bytes([97, 10, 2])

    def u128(off: int, v: int) -> None:
        page[off:off + 16] = v.to_bytes(16, "little")

    for off, v in ((32, 11), (48, (1 << 70) + 5), (64, 13), (80, 14), (96, 15), (112, 16), (128, 17), (144, 18),
                   (160, 19), (176, 20)):
        u128(off, v)
    s = parse_smart_log(bytes(page))
    assert (s.critical_warning, s.temperature_kelvin, s.temperature_celsius) == (4, 318, 45)
    assert (s.available_spare, s.available_spare_threshold, s.percentage_used) == (97, 10, 2)
    assert (s.data_units_read, s.data_units_written, s.host_read_commands, s.host_write_commands) == \
        (11, (1 << 70) + 5, 13, 14)
    assert (s.controller_busy_minutes, s.power_cycles, s.power_on_hours, s.unsafe_shutdowns, s.media_errors,
            s.error_log_entries) == (15, 16, 17, 18, 19, 20)
    assert s.to_dict()["data_written_bytes"] == ((1 << 70) + 5) * 512_000
    with pytest.raises(ValueError, match="512 bytes"):
        parse_smart_log(bytes(100))


def test_a_refused_smart_read_names_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[bytes] = []

    def refuse(fd: int, request: int, arg: bytearray, mutate: bool) -> int:
        sent.append(bytes(arg))
        assert request == smart.NVME_IOCTL_ADMIN_CMD and len(arg) == 72
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(smart.fcntl, "ioctl", refuse)
    with pytest.raises(SmartUnavailable) as e:
        read_smart_log(7, "/dev/ng0n1")
    assert e.value.errno == errno.EACCES and "\n" not in e.value.strerror
    assert e.value.strerror.startswith("/dev/ng0n1: the drive's SMART / Health log (NVMe Get Log Page 02h) is "
                                       "refused (EACCES)")
    assert "CAP_SYS_ADMIN" in e.value.strerror and "cap-sys-admin.conf" in e.value.strerror
    # the command: Get Log Page, all namespaces, LID 02h with RAE, 128 dwords
    opcode, _, _, nsid = struct.unpack_from("<BBHI", sent[0])
    cdw10 = struct.unpack_from("<I", sent[0], 40)[0]
    data_len = struct.unpack_from("<I", sent[0], 36)[0]
    assert (opcode, nsid, data_len, cdw10) == (0x02, 0xFFFFFFFF, 512, 0x02 | 1 << 15 | 127 << 16)


def test_the_kernel_counts_what_reaches_the_disk(tmp_path) -> None:
    """A file written with O_DIRECT (nothing for writeback to add later) shows up in its device's count."""
    b = block_stat_of(str(tmp_path))
    if isinstance(b, str):
        pytest.skip(f"the test directory is on no block device here: {b}")
    assert isinstance(b, BlockStat) and os.path.basename(os.path.dirname(os.path.realpath(b.stat_path))) == b.name
    nbytes = 4 << 20
    before = b.written_bytes()
    fd = os.open(tmp_path / "direct.bin", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    try:
        with mmap.mmap(-1, nbytes) as buf:
            buf.write(b"\xa5" * nbytes)
            assert os.pwritev(fd, [buf], 0) == nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    assert b.written_bytes() - before >= nbytes       # other writers of the disk can only add
    shm = block_stat_of("/dev/shm")
    assert isinstance(shm, str) and "no block device" in shm, shm
    assert diskstats.SECTOR_BYTES == 512


# -- a real daemon ----------------------------------------------------------------------------------------
def session_row(c: Client, sid: str) -> dict[str, Any]:
    (row,) = [r for r in c.sessions() if r["session"] == sid]
    return row


def test_a_direct_session_counts_exactly_what_it_wrote(tmp: str) -> None:
    """Whole-LBA rows: every byte bladed writes to the device is a KV byte the session wrote (no amplification of
    its own: ratio 1.0), through the lane (data connection) and the general path (JSON) alike."""
    cfg = {"metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        before = c.wear()["today"]["direct_bytes"]
        with c.open_session(ALIGNED, mode="direct", channels=2) as s:
            io_before = io_written(d.pid)
            for layer in range(4):
                for kind in "kv":
                    s.write(layer, kind, layer % 2, 0, 20)              # a prefill of 20 tokens, by the lane
            for t in range(20, 26):
                for layer in range(4):
                    s.write(layer, "k", 0, t, 1)                      # decode appends
            c.call("write", session=s.id, layer=3, kind="v", channel=1, token_start=20, ntokens=4)   # JSON
            row = session_row(c, s.id)
            kernel = io_written(d.pid) - io_before
            kv = 8 * 20 * 4096 + 6 * 4 * 4096 + 4 * 4096
            assert kv <= kernel <= kv + 2 * 4096, kernel   # the kernel's count: no more went to storage
            assert row["kv_written_bytes"] == {"pagecache": 0, "direct": kv}
            assert row["direct_written_by_cause"] == {"requests": kv, "demotion": 0, "extent_move": 0, "prefix": 0}
            assert row["direct_written_bytes"] == kv
            ratio = row["direct_written_bytes"] / row["kv_written_bytes"]["direct"]
            assert ratio <= 1.02
            print(f"whole-LBA rows: device bytes / KV bytes on the direct path = {ratio:.4f} ({kv} bytes)")
            stats = c.stats()
            assert stats["direct_written_by_cause"]["requests"] == kv and stats["direct_written_bytes"] == kv
            assert stats["io"]["direct"]["write"]["bytes"] == kv
            m = scrape(UnixHTTPConnection(os.path.join(tmp, "metrics.sock")))
            assert m[("bladed_direct_written_bytes_total", (("cause", "requests"),))] == kv
            assert m[("bladed_wear_written_today_bytes", (("cause", "requests"),))] == kv + before
        # closed: the counts stay in the daemon's totals and in the ledger
        assert c.stats()["direct_written_bytes"] == kv
        w = c.wear()
        assert w["today"]["direct_bytes"] == before + kv and w["today"]["direct"]["requests"] >= kv
        assert w["write_budget"]["bytes"] == 0 and not w["write_budget"]["exhausted"]
        assert w["backend"] == "file" and w["smart"] is None and "no NVMe SMART log" in w["smart_error"]
        store = w["kernel"]["store"]
        if store["device"] is not None:
            # O_DIRECT writes of the file store reach the disk: the kernel's count has at least bladed's
            assert store["written_bytes"] >= kv and store["passthrough_counted"] is None


def io_written(pid: int) -> int:
    """What the kernel says process ``pid`` had written to storage (``/proc/PID/io`` ``write_bytes``: an O_DIRECT
    write when it is issued, a page-cache write when it dirties its pages)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("write_bytes:"))


def test_packed_rows_count_every_lba_the_device_writes(tmp: str) -> None:
    """Rows of 768 bytes on 4 KiB LBAs: bladed's count is what the kernel says the daemon wrote to the store (its
    O_DIRECT writes), whatever LBAs the packed layout has to write; the amplification is measured and printed."""
    with DaemonProcess(tmp).start() as d, Client(d.socket_path) as c, \
            c.open_session(PACKED, mode="direct", channels=1) as s:
        before = io_written(d.pid)
        for t0, n in [(0, 37)] + [(t, 1) for t in range(37, 64)]:   # a prefill of 37 tokens, then appends
            for layer in range(2):
                for kind in "kv":
                    s.write(layer, kind, 0, t0, n)
        row = session_row(c, s.id)
        kernel = io_written(d.pid) - before
        kv = 4 * 64 * ROW
        assert row["kv_written_bytes"]["direct"] == kv
        counted = row["direct_written_by_cause"]["requests"]
        assert counted % LBA == 0 and counted >= kv           # whole LBAs, every KV byte among them
        # the daemon wrote nothing else meanwhile but, at most, a few pages of its own small files (the journal,
        # the wear ledger: a page per rewrite)
        assert counted <= kernel <= counted + 8 * 4096, (counted, kernel)
        print(f"packed rows ({ROW} B on {LBA} B LBAs), a prefill of 37 tokens and 27 one-token appends: device "
              f"bytes / KV bytes = {counted / kv:.3f}")


def test_a_live_demotion_counts_as_a_demotion(tmp: str) -> None:
    cfg = {"budget": {"override": 4 * KPU}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c, c.open_session(ALIGNED, channels=1) as s:
        assert s.plan["group1_layers"] == 2
        for layer in range(4):
            for kind in "kv":
                s.write(layer, kind, 0, 0, 9)
        d.config["budget"]["override"] = 2 * KPU
        d.write_config()
        hup = d.signal(signal.SIGHUP)
        for kpu in ("k1", "v1"):
            d.wait_event("kpu_demoted", after=hup, session=s.id, kpu=kpu)
        row = session_row(c, s.id)
        assert row["demoted_bytes"] == 2 * 9 * 4096
        assert row["direct_written_by_cause"] == {"requests": 4 * 9 * 4096, "demotion": 2 * 9 * 4096,
                                                  "extent_move": 0, "prefix": 0}
        assert c.stats()["direct_written_by_cause"]["demotion"] == 2 * 9 * 4096


def test_the_write_budget_refuses_new_direct_spills_and_nothing_else(tmp: str) -> None:
    budget = 64 << 10
    cfg = {"io": {"write_budget": "64K"}, "budget": {"override": 6 * KPU},
           "prefix": {"pagecache_bytes": 0}, "metrics": {"enabled": True, "listen": "unix:metrics.sock"}}
    two_layers = dict(ALIGNED, layers=2, batch=1, kv_heads=16)         # batch 1 (a prefix is one sequence), same KPU
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        # opened while the budget is not spent: a dualblade session all in the page cache (4 of B_pc's 6 KPUs)
        # and a direct one
        dual = c.open_session(two_layers, channels=1)
        assert dual.plan["group1_layers"] == 2
        with c.open_session(ALIGNED, mode="direct", channels=1) as s:
            s.write(0, "k", 0, 0, 32)                                # 128 KiB: the budget is spent
            s.write(0, "k", 0, 0, 1)                                 # an open session keeps writing
        spent = c.wear()["today"]["direct_bytes"]
        assert spent == KPU + 4096

        with pytest.raises(WriteBudgetExhaustedError) as e:
            c.open_session(ALIGNED, mode="direct", channels=1)
        msg = str(e.value)
        assert e.value.code is ErrorCode.WRITE_BUDGET_EXHAUSTED and "\n" not in msg
        assert msg.startswith("a direct session with 8 KPUs (1048576 bytes) on the direct path refused: ")
        assert f"bladed has written {format_size(spent)} to the device today (UTC)" in msg
        assert f"io.write_budget allows {format_size(budget)} a day" in msg and "00:00 UTC, in " in msg
        # a dualblade session that spills is refused too; sessions that stay in the page cache open
        with pytest.raises(WriteBudgetExhaustedError):
            c.open_session(ALIGNED, channels=1)                       # 1 layer in what B_pc has left, 3 direct
        with c.open_session(ALIGNED, mode="cachepolicy", channels=1) as pc:
            assert pc.write(0, "k", 0, 0, 4).path == "pagecache"
        with c.open_session(dict(ALIGNED, layers=1), channels=1) as fits:   # 2 KPUs: all in what B_pc has left
            assert fits.plan["group1_layers"] == 1

        # retaining a prefix that needs the device (no page cache for prefixes here) is refused
        for layer in range(2):
            for kind in "kv":
                dual.write(layer, kind, 0, 0, 16)
        refused = r"^retaining a prefix with \d+ bytes on the device refused: "
        with pytest.raises(WriteBudgetExhaustedError, match=refused):
            dual.retain(list(range(16)), PrefixKey("m", "fp16"))

        # a live demotion is refused: the KPUs stay on the page-cache path
        d.config["budget"]["override"] = 2 * KPU
        d.write_config()
        hup = d.signal(signal.SIGHUP)
        for kpu in ("k1", "v1"):
            failed = d.wait_event("kpu_demotion_failed", after=hup, session=dual.id, kpu=kpu)
            # one refusal names the KPUs the demotion carried together (both, or each on its own)
            assert "io.write_budget" in failed["error"] and re.match(
                rf"a live demotion of (k1,v1|{kpu}) of session {dual.id} \(({KPU}|{2 * KPU}) bytes\) refused: ",
                failed["error"]), failed["error"]
        row = session_row(c, dual.id)
        assert (row["group1_kpus"], row["demotions_failed"], row["direct_written_bytes"]) == (4, 2, 0)

        w = c.wear()["write_budget"]
        assert w == {"bytes": budget, "spent_bytes": spent, "left_bytes": 0, "exhausted": True,
                     "refusals": {"session": 2, "demotion": 2, "prefix": 1}}
        assert c.stats()["bad_requests_by_code"]["write_budget_exhausted"] == 3
        m = scrape(UnixHTTPConnection(os.path.join(tmp, "metrics.sock")))
        assert m[("bladed_write_budget_bytes", ())] == budget
        assert m[("bladed_write_budget_refusals_total", (("what", "demotion"),))] == 2
        assert m[("bladed_requests_refused_total", (("code", "write_budget_exhausted"),))] == 3

        # the operator raises the budget: a reload applies it to the next open
        d.config["io"]["write_budget"] = "1G"
        d.write_config()
        hup = d.signal(signal.SIGHUP)
        d.wait_event("reload", after=hup, applied="io.write_budget")
        with c.open_session(ALIGNED, mode="direct", channels=1) as again:
            assert again.write(1, "v", 0, 0, 1).path == "direct"
        dual.close()


def test_the_ledger_outlives_the_daemon(tmp: str) -> None:
    with DaemonProcess(tmp).start() as d:
        with Client(d.socket_path) as c, c.open_session(ALIGNED, mode="direct", channels=1) as s:
            s.write(2, "v", 0, 0, 8)
        assert d.stop() == 0                  # a clean stop writes the ledger last
        d.start()
        with Client(d.socket_path) as c:
            assert c.stats()["direct_written_bytes"] == 0        # counters start again with the daemon
            w = c.wear()
            assert w["since_install"]["direct"]["requests"] == 8 * 4096
            assert w["today"]["direct"]["requests"] == 8 * 4096
            with c.open_session(ALIGNED, mode="direct", channels=1) as s:
                s.write(0, "v", 0, 0, 2)
            assert c.wear()["since_install"]["direct"]["requests"] == 10 * 4096
    with open(os.path.join(tmp, LEDGER_NAME)) as f:
        assert json.load(f)["total"]["direct"]["requests"] == 10 * 4096


def test_bladectl_wear_and_stats_show_it(tmp: str) -> None:
    with DaemonProcess(tmp, {"io": {"write_budget": "1M"}, "device": {"endurance_tbw": 600}}).start() as d:
        with Client(d.socket_path) as c, c.open_session(ALIGNED, mode="direct", channels=1) as s:
            s.write(0, "k", 0, 0, 4)
        r = CliRunner().invoke(cli, ["--socket", d.socket_path, "wear"])
        assert r.exit_code == 0, r.output
        lines = {ln.split("  ")[0]: ln for ln in r.output.splitlines()}
        print(r.output)
        assert "16.0 KiB (requests 16.0 KiB)" in lines["written by bladed today"]
        assert "16.0 KiB of 1.0 MiB a day, 1008.0 KiB left" in lines["write budget (io.write_budget)"]
        assert "unavailable: the file backend has no NVMe SMART log" in lines["drive (SMART)"]
        j = CliRunner().invoke(cli, ["--socket", d.socket_path, "wear", "--json"])
        data = json.loads(j.output)
        assert data["today"]["direct"]["requests"] == 16384 and data["endurance"]["bytes"] == 600 * 10**12
        assert data["endurance"]["days_left"] is None and "no SMART log" in data["endurance"]["why"]
        st = CliRunner().invoke(cli, ["--socket", d.socket_path, "stats"])
        assert st.exit_code == 0 and "written by bladed" in st.output and "requests 16.0 KiB" in st.output
