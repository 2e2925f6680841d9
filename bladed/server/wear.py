"""The wear ledger: what bladed wrote to its device today and since install, and the drive's SMART readings
over time, kept in the state directory (``wear.json``); and the write budget (``io.write_budget``) it holds
new direct-path spills to.

* **Counts** come from counters that start at 0 with the daemon (``counters()``: bladed's own direct-path
  writes by cause, and the kernel's count of each device's writes by role); every pull adds their growth
  since the last one to today's and the lifetime figures.
* **The day** is the UTC calendar day: at 00:00 UTC today's figures move to the list of past days
  (:data:`KEEP_DAYS` kept) and the write budget starts again.  Growth pulled across midnight counts for
  the new day (pulls are at most :data:`FLUSH_INTERVAL_S` apart).
* **SMART readings** of the drive (NVMe only), at most one per :data:`SMART_INTERVAL_S`, kept
  :data:`KEEP_DAYS` days: the percentage-used trend and the written rate that days-left uses.
* **Persistence**: :meth:`WearLedger.flush` writes the file atomically (a temporary file, fsync, rename,
  fsync of the directory); the daemon flushes every :data:`FLUSH_INTERVAL_S` and at stop, so a crash loses
  at most that much.  A missing file starts a fresh ledger; an unreadable one is kept as ``wear.json.corrupt``
  and a fresh ledger starts, with one warning.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from bladed.config import format_size
from bladed.io.smart import DATA_UNIT_BYTES
from bladed.protocol import ErrorCode, RequestError

log = logging.getLogger("bladed.wear")

LEDGER_NAME = "wear.json"
VERSION = 1
#: the daemon's flush period: a crash loses at most this much of the counts
FLUSH_INTERVAL_S = 60.0
#: one SMART reading kept per this period
SMART_INTERVAL_S = 3600.0
#: past days and SMART readings kept
KEEP_DAYS = 30
#: SMART readings closer than this give no rate
MIN_TREND_S = 3600.0
#: what a refused spill was (``bladed_write_budget_refusals_total{what}``)
SPILLS = ("session", "demotion", "prefix")
#: the SMART fields a reading keeps
SMART_FIELDS = ("data_units_written", "data_units_read", "host_write_commands", "host_read_commands",
                "percentage_used", "available_spare", "media_errors", "power_on_hours", "critical_warning",
                "temperature_kelvin")
DAY_S = 86400.0

#: (bladed's direct-path bytes by cause, the kernel's device bytes by role), both counted from the daemon's start
Counters = Callable[[], tuple[Mapping[str, int], Mapping[str, int]]]


def utc_day(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d")


def day_end(t: float) -> float:
    """The next 00:00 UTC after ``t``."""
    d = datetime.datetime.fromtimestamp(t, datetime.UTC).date() + datetime.timedelta(days=1)
    return datetime.datetime(d.year, d.month, d.day, tzinfo=datetime.UTC).timestamp()


def _figures() -> dict[str, dict[str, int]]:
    return {"direct": {}, "device": {}}


def _fresh(now: float) -> dict[str, Any]:
    return {"version": VERSION, "installed": now, "day": utc_day(now), "today": _figures(), "total": _figures(),
            "days": [], "smart": {"drive": None, "readings": []}}


def _is_counts(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in x.items())


def _valid(d: Any) -> bool:
    """Whether ``d`` is a ledger this version can carry on from."""
    try:
        return (d["version"] == VERSION and isinstance(d["installed"], int | float) and isinstance(d["day"], str)
                and all(_is_counts(d[w][k]) for w in ("today", "total") for k in ("direct", "device"))
                and isinstance(d["days"], list)
                and all(isinstance(x["day"], str) and _is_counts(x["direct"]) and _is_counts(x["device"])
                        for x in d["days"])
                and isinstance(d["smart"]["readings"], list)
                and all(isinstance(r["time"], int | float) and all(type(r[k]) is int for k in SMART_FIELDS)
                        for r in d["smart"]["readings"]))
    except (KeyError, TypeError):
        return False


class WearLedger:
    """Today's and lifetime writes, past days, SMART readings; the write budget's check.  Thread-safe."""

    def __init__(self, path: str, counters: Counters, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._counters = counters
        self._clock = clock
        self._lock = threading.Lock()
        #: the counters at the last pull
        self._seen: dict[str, dict[str, int]] = _figures()
        #: spills refused since the daemon started, by what they were
        self.refusals = dict.fromkeys(SPILLS, 0)
        self._dirty = False
        self._flush_failed = False
        self.state = self._load()

    # -- the file -------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        now = self._clock()
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            log.info("wear ledger: no %s yet; starting a fresh one", self.path)
            self._dirty = True
            return _fresh(now)
        except (OSError, ValueError) as e:
            data, why = None, str(e)
        else:
            why = "not a wear ledger of this version"
        if _valid(data):
            return data
        aside = self.path + ".corrupt"
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)
        log.warning("wear ledger %s is unreadable (%s); kept as %s, starting a fresh one (the counts before "
                    "today are lost)", self.path, why, aside)
        self._dirty = True
        return _fresh(now)

    def flush(self) -> bool:
        """Pull the counters and write the ledger if it changed (atomically); False if the write failed."""
        with self._lock:
            self._pull()
            if not self._dirty:
                return True
            text = json.dumps(self.state, separators=(",", ":"))
            self._dirty = False
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            with self._lock:
                self._dirty = True
            if not self._flush_failed:
                log.warning("wear ledger: cannot write %s (%s); the counts since the last write are kept in memory "
                            "and tried again", self.path, e)
            self._flush_failed = True
            return False
        if self._flush_failed:
            log.info("wear ledger: %s written again", self.path)
            self._flush_failed = False
        return True

    # -- counting -------------------------------------------------------------------------
    def _roll(self, now: float) -> None:
        """Move today's figures to the past days once the UTC day has changed."""
        s = self.state
        today = utc_day(now)
        if today == s["day"]:
            return
        s["days"] = ([*s["days"], {"day": s["day"], **copy.deepcopy(s["today"])}])[-KEEP_DAYS:]
        s["day"] = today
        s["today"] = _figures()
        self._dirty = True

    def _pull(self) -> None:
        """Roll the day, then add the counters' growth since the last pull (the caller holds the lock)."""
        self._roll(self._clock())
        direct, device = self._counters()
        s = self.state
        for kind, now in (("direct", direct), ("device", device)):
            seen = self._seen[kind]
            for key, value in now.items():
                grown = value - seen.get(key, 0)
                seen[key] = value
                if grown > 0:
                    for where in ("today", "total"):
                        counts = s[where][kind]
                        counts[key] = counts.get(key, 0) + grown
                    self._dirty = True

    def today_direct_bytes(self) -> int:
        """What bladed's own commands wrote to the device today (UTC)."""
        with self._lock:
            self._pull()
            return sum(self.state["today"]["direct"].values())

    def check_spill(self, what: str, description: str, budget: int, count: int = 1) -> None:
        """Refuse a new direct-path spill (``what``: one of :data:`SPILLS`; ``count`` of them, e.g. the KPUs of one
        demotion) once today's writes reached ``budget`` (``io.write_budget``; 0 = off): RequestError
        ``write_budget_exhausted``, one line."""
        if not budget:
            return
        with self._lock:
            self._pull()
            spent = sum(self.state["today"]["direct"].values())
            if spent < budget:
                return
            self.refusals[what] = self.refusals.get(what, 0) + count
            now = self._clock()
        left = int(day_end(now) - now)
        raise RequestError(ErrorCode.WRITE_BUDGET_EXHAUSTED,
                           f"{description} refused: bladed has written {format_size(spent)} to the device today "
                           f"(UTC), io.write_budget allows {format_size(budget)} a day; the day rolls over at 00:00 "
                           f"UTC, in {left // 3600} h {left % 3600 // 60:02d} min; raise io.write_budget (a reload "
                           "applies it) or use the page-cache path (a session that fits B_pc)")

    def record_smart(self, reading: Mapping[str, Any], drive: str) -> bool:
        """Keep one SMART reading of ``drive`` (model and serial) if the last one is at least about an hour old;
        readings of another drive are dropped first.  True if it was kept."""
        now = self._clock()
        with self._lock:
            smart = self.state["smart"]
            if smart.get("drive") != drive:
                if smart.get("drive") is not None:
                    log.info("wear ledger: the drive is now %s (was %s); its SMART history starts again", drive,
                             smart["drive"])
                smart["drive"], smart["readings"] = drive, []
            readings = smart["readings"]
            if readings and now - readings[-1]["time"] < 0.9 * SMART_INTERVAL_S:
                return False
            readings.append({"time": now} | {k: int(reading[k]) for k in SMART_FIELDS})
            smart["readings"] = [r for r in readings if r["time"] >= now - KEEP_DAYS * DAY_S]
            self._dirty = True
            return True

    # -- reporting ------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """Today's and lifetime figures (pulled now): for the gauges."""
        with self._lock:
            self._pull()
            s = copy.deepcopy(self.state)
        return {"day": s["day"], "installed": s["installed"], "today": s["today"], "total": s["total"],
                "refusals": dict(self.refusals)}

    def report(self, smart: Mapping[str, Any] | None, endurance: tuple[int, str] | None, budget: int) -> dict[str, Any]:
        """The ``wear`` op's ledger part: bladed's writes today, since install and per past day, the write
        budget, the SMART trend, and days left (``endurance``: rated bytes and where that came from)."""
        now = self._clock()
        with self._lock:
            self._pull()
            s = copy.deepcopy(self.state)
            refusals = dict(self.refusals)
        spent = sum(s["today"]["direct"].values())

        def figures(f: dict[str, dict[str, int]]) -> dict[str, Any]:
            return {"direct_bytes": sum(f["direct"].values()), "direct": f["direct"], "device": f["device"]}

        readings = s["smart"]["readings"]
        trend = _trend(readings, smart, now)
        return {
            "time": now, "installed": s["installed"], "day": s["day"], "day_ends": day_end(now),
            "today": figures(s["today"]), "since_install": figures(s["total"]),
            "days": [{"day": d["day"]} | figures(d) for d in s["days"]],
            "write_budget": {"bytes": budget, "spent_bytes": spent,
                             "left_bytes": max(0, budget - spent) if budget else None,
                             "exhausted": bool(budget) and spent >= budget, "refusals": refusals},
            "smart_history": {"readings": len(readings), "since": readings[0]["time"] if readings else None,
                              "drive": s["smart"]["drive"]},
            "trend": trend,
            "endurance": _endurance(endurance, smart, trend),
        }


def _trend(readings: list[dict[str, Any]], smart: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """Rates from the oldest kept SMART reading to the newest (the live one if given)."""
    points = [*readings, *([{"time": now} | dict(smart)] if smart is not None else [])]
    out: dict[str, Any] = {"since": None, "days": 0.0, "data_written_bytes_per_day": None,
                           "percentage_used_per_day": None}
    if len(points) < 2 or points[-1]["time"] - points[0]["time"] < MIN_TREND_S:
        return out
    first, last = points[0], points[-1]
    span = last["time"] - first["time"]
    out["since"] = first["time"]
    out["days"] = span / DAY_S
    out["data_written_bytes_per_day"] = (last["data_units_written"] - first["data_units_written"]) * DATA_UNIT_BYTES \
        / span * DAY_S
    out["percentage_used_per_day"] = (last["percentage_used"] - first["percentage_used"]) / span * DAY_S
    return out


def _endurance(endurance: tuple[int, str] | None, smart: Mapping[str, Any] | None,
               trend: dict[str, Any]) -> dict[str, Any]:
    """Days left at the current rate, with what each figure came from, or why it is unknown."""
    out: dict[str, Any] = {"bytes": None, "source": None, "written_bytes": None, "rate_bytes_per_day": None,
                           "rate_basis": None, "days_left": None, "days_left_by_percentage_used": None, "why": None}
    if smart is not None:
        out["written_bytes"] = smart["data_units_written"] * DATA_UNIT_BYTES
        per_day = trend["percentage_used_per_day"]
        if per_day:
            out["days_left_by_percentage_used"] = max(0.0, (100 - smart["percentage_used"]) / per_day)
        if trend["data_written_bytes_per_day"] is not None:
            out["rate_bytes_per_day"], out["rate_basis"] = trend["data_written_bytes_per_day"], "smart_trend"
        elif smart["power_on_hours"] >= 1:
            out["rate_bytes_per_day"] = out["written_bytes"] / smart["power_on_hours"] * 24
            out["rate_basis"] = "lifetime_average"
    if endurance is None:
        out["why"] = "no rated endurance: set device.endurance_tbw (the drive's TBW)"
        return out
    out["bytes"], out["source"] = endurance
    if smart is None:
        out["why"] = ("the drive's own count of bytes written is unknown here (no SMART log: not the nvme backend, "
                      "or refused)")
    elif not out["rate_bytes_per_day"]:
        out["why"] = "no writes to measure a rate by yet"
    else:
        out["days_left"] = max(0.0, (out["bytes"] - out["written_bytes"]) / out["rate_bytes_per_day"])
    return out


__all__ = ["FLUSH_INTERVAL_S", "LEDGER_NAME", "SMART_INTERVAL_S", "SPILLS", "WearLedger", "day_end", "utc_day"]
