"""The daemon's eye on its drive: the wear ledger (``bladed.server.wear``) fed and flushed on a timer, the
drive's SMART / Health log (nvme backend, by admin passthrough: ``bladed.io.smart``) sampled for the
ledger's trend, and the kernel's count of what the store's and the page-cache directory's block devices
wrote since the daemon started (``bladed.io.diskstats``).  Answers the ``wear`` op and the wear gauges."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from bladed.config import Config
from bladed.io import ExtentDevice
from bladed.io.diskstats import BlockStat, block_stat_of
from bladed.io.smart import SmartLog, SmartUnavailable, endurance_estimate, read_smart_log
from bladed.server.metrics import Stats
from bladed.server.wear import FLUSH_INTERVAL_S, LEDGER_NAME, SMART_INTERVAL_S, WearLedger

log = logging.getLogger("bladed.wear")

#: the gauges' SMART reading may be this old (a scrape every few seconds sends one admin command at most this often)
GAUGE_SMART_MAX_AGE_S = 10.0
#: the roles of the block devices the kernel's count is kept for
ROLES = ("store", "pagecache")


class WearWatch:
    """The wear ledger, its timer, the drive's SMART figures and the kernel's written bytes per role."""

    def __init__(self, cfg: Config, device: ExtentDevice, stats: Stats) -> None:
        self.cfg = cfg
        self.device = device
        self.stats = stats
        self.blocks: dict[str, BlockStat | str] = {
            "store": block_stat_of(device.path), "pagecache": block_stat_of(cfg.pagecache_dir)}
        self._base: dict[str, int] = {}
        for role, b in self.blocks.items():
            if isinstance(b, BlockStat):
                try:
                    self._base[role] = b.written_bytes()
                except (OSError, ValueError, IndexError) as e:
                    self.blocks[role] = f"{b.stat_path}: {e}"
        self.ledger = WearLedger(os.path.join(cfg.state_dir, LEDGER_NAME), self.counters)
        self._lock = threading.Lock()
        self._smart: SmartLog | None = None
        self._smart_at = 0.0
        self.smart_error: str | None = (None if device.kind == "nvme" else
                                        f"the {device.kind} backend has no NVMe SMART log: the kernel's count of "
                                        "the block device's written bytes is all there is (kernel, below)")
        self.drive_endurance = endurance_estimate(device.fd) if device.kind == "nvme" else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- figures ----------------------------------------------------------------------------
    def kernel_written(self) -> dict[str, int]:
        """Bytes the kernel says each role's block device wrote since the daemon started (all writers)."""
        out = {}
        for role, base in self._base.items():
            b = self.blocks[role]
            assert isinstance(b, BlockStat)
            try:
                out[role] = b.written_bytes() - base
            except (OSError, ValueError, IndexError):
                continue
        return out

    def counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """What the ledger pulls: bladed's direct-path writes by cause, the kernel's per role (since start)."""
        return self.stats.direct_written(), self.kernel_written()

    def smart(self, max_age_s: float = 0.0) -> SmartLog | None:
        """The drive's SMART / Health log, read anew if the last reading is older than ``max_age_s``; None where
        there is none (:attr:`smart_error` says why)."""
        if self.device.kind != "nvme":
            return None
        with self._lock:
            now = time.monotonic()
            if self._smart is None or now - self._smart_at > max_age_s:
                try:
                    self._smart = read_smart_log(self.device.fd, self.device.path)
                    self._smart_at = now
                    self.smart_error = None
                except SmartUnavailable as e:
                    self._smart, self.smart_error = None, e.strerror
            return self._smart

    def endurance(self) -> tuple[int, str] | None:
        """The rated bytes written and where they came from: ``device.endurance_tbw``, else the drive's estimate."""
        if self.cfg.device.endurance_tbw:
            return int(self.cfg.device.endurance_tbw * 1e12), "device.endurance_tbw"
        if self.drive_endurance:
            return self.drive_endurance, "drive"
        return None

    def _sample_smart(self) -> None:
        s = self.smart()
        ident = getattr(self.device, "identity", None)
        if s is not None and ident is not None:
            self.ledger.record_smart(s.to_dict(), f"{ident.model} {ident.serial}")

    # -- the timer ---------------------------------------------------------------------------
    def start(self) -> None:
        """A first SMART reading (one warning if it is refused), then flush and sample on the timer."""
        self._sample_smart()
        if self.device.kind == "nvme" and self.smart_error:
            log.warning("wear: %s", self.smart_error)
        self.ledger.flush()
        self._thread = threading.Thread(target=self._run, name="bladed-wear", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_smart = time.monotonic() + SMART_INTERVAL_S
        while not self._stop.wait(FLUSH_INTERVAL_S):    # the ledger's period, not a synchronisation
            if time.monotonic() >= next_smart:
                self._sample_smart()
                next_smart = time.monotonic() + SMART_INTERVAL_S
            self.ledger.flush()

    def stop(self) -> None:
        """Stop the timer and write the ledger a last time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.ledger.flush()

    # -- reporting ---------------------------------------------------------------------------
    def _kernel(self) -> dict[str, Any]:
        written = self.kernel_written()
        out: dict[str, Any] = {}
        for role in ROLES:
            b = self.blocks[role]
            path = self.device.path if role == "store" else self.cfg.pagecache_dir
            if isinstance(b, str):
                out[role] = {"path": path, "device": None, "written_bytes": None, "why": b}
                continue
            # NVMe passthrough (the nvme backend's I/O) reaches the namespace's count only where the kernel is asked
            counted = b.passthrough_counted if role == "store" and self.device.kind == "nvme" else None
            out[role] = {"path": path, "device": b.name, "written_bytes": written.get(role),
                         "passthrough_counted": counted}
        return out

    def report(self) -> dict[str, Any]:
        """The ``wear`` op: the ledger's figures, the drive's SMART log read now, the kernel's counts."""
        smart = self.smart()
        d = smart.to_dict() if smart is not None else None
        return {"backend": self.device.kind, "device": self.device.path,
                "smart": d, "smart_error": self.smart_error, "kernel": self._kernel(),
                } | self.ledger.report(d, self.endurance(), self.cfg.io.write_budget)

    def gauges(self) -> dict[str, Any]:
        """What the Prometheus collector shows of wear (SMART at most GAUGE_SMART_MAX_AGE_S old)."""
        smart = self.smart(GAUGE_SMART_MAX_AGE_S)
        d = smart.to_dict() if smart is not None else None
        r = self.ledger.report(d, self.endurance(), self.cfg.io.write_budget)
        return {"today": r["today"]["direct"], "since_install": r["since_install"]["direct"],
                "write_budget_bytes": self.cfg.io.write_budget, "refusals": r["write_budget"]["refusals"],
                "kernel": self._kernel(), "smart": d, "endurance_bytes": r["endurance"]["bytes"],
                "days_left": r["endurance"]["days_left"]}


__all__ = ["WearWatch"]
