"""Start-up and teardown of what the daemon holds on storage: opening the device, reclaiming what a
crashed instance left, and scrubbing freed blocks so no session reads another's bytes."""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Any

from bladed.config import Config, ConfigError, validate_device
from bladed.io import Engine, ExtentDevice, StagingBuffer, open_device
from bladed.io.engines import EngineSettingError
from bladed.residency.extents import ExtentAllocator
from bladed.server.daemon.systemd import sd_notify
from bladed.server.events import event
from bladed.server.metrics import Stats
from bladed.server.storage.journal import QUARANTINED, READY, Journal, RetainedRecord, SessionRecord
from bladed.server.storage.pagecache_store import sweep_pagecache
from bladed.server.storage.release import scrub
from bladed.sizes import PAGE_SIZE

log = logging.getLogger("bladed")

#: how long a start-up may spend scrubbing the whole region before systemd gives up on it
SCRUB_START_TIMEOUT_S = 1800


def open_store_device(cfg: Config) -> ExtentDevice:
    """The configured device (``device.*``), checked against the configuration; ConfigError naming the key."""
    d = cfg.device
    path = cfg.device_path
    opts: dict[str, Any] = {}
    if d.backend == "file":
        if not os.path.exists(path) and not d.size:
            raise ConfigError([f"device.path: store file {path} does not exist and device.size is 0"], cfg.source)
        if not os.path.isdir(os.path.dirname(path)):
            raise ConfigError([f"device.path: directory {os.path.dirname(path)} does not exist"], cfg.source)
        opts = {"size_bytes": d.size or None, "lba_size": d.lba_size or 4096, "max_command_bytes": d.max_command_bytes}
    elif d.backend == "block":
        opts = {"max_command_bytes": d.max_command_bytes}
    if d.backend != "file" and not os.path.exists(path):
        raise ConfigError([f"device.path: {path} does not exist (missing device; check `bladectl ns list`)"],
                          cfg.source)
    try:
        dev = open_device(d.backend, path, engine=cfg.io.engine, **opts)
    except EngineSettingError as e:
        raise ConfigError([str(e)], cfg.source) from None
    except PermissionError as e:
        raise ConfigError([f"device.path: no permission to open {path} read-write ({e.strerror})"],
                          cfg.source) from None
    except (OSError, ValueError) as e:
        raise ConfigError([f"device.path: cannot use {path} as a {d.backend} device: {e}"], cfg.source) from None
    problems = validate_device(cfg, lba_size=dev.lba_size, capacity_blocks=dev.capacity_blocks, path=path)
    if d.backend == "nvme" and not problems:
        refused = passthrough_refused(dev)
        problems = [refused] if refused else []
    if problems:
        dev.close()
        raise ConfigError(problems, cfg.source)
    return dev


#: what a denied passthrough command fails with: seccomp (EPERM), an LSM (EACCES), no such ioctl or opcode
_REFUSALS = (errno.EPERM, errno.EACCES, errno.ENOTTY, errno.EOPNOTSUPP, errno.ENOSYS)


def passthrough_refused(dev: ExtentDevice) -> str | None:
    """Why the nvme backend cannot move data on ``dev`` with its engine, or None: one read of LBA 0 by NVMe
    passthrough (io_uring_cmd, or the portable engine's ioctl) at start, so that a process allowed neither is a
    one-line start-up error rather than a daemon whose first session fails."""
    with StagingBuffer(max(dev.lba_size, PAGE_SIZE)) as buf, Engine(dev, 1) as eng:
        try:
            eng.read(0, buf, nbytes=dev.lba_size)
        except OSError as e:
            if e.errno not in _REFUSALS:
                return None        # a media error and the like: the device's problem, not this process's
            how = "io_uring_cmd" if dev.engine == "uring" else "the NVMe passthrough ioctl (NVME_IOCTL_IO64_CMD)"
            return (f"device.path: {dev.path}: NVMe passthrough by {how} is refused here "
                    f"({errno.errorcode.get(e.errno or 0, e.errno)}: {os.strerror(e.errno or 0)}); allow io_uring "
                    "or the NVMe ioctls for bladed (docs/operations.md, 'In a container'), or use the block backend")
    return None


def reclaim(cfg: Config, dev: ExtentDevice, allocator: ExtentAllocator, journal: Journal,
            stats: Stats) -> list[RetainedRecord]:
    """Scrub what a crashed instance left and remove its page-cache files; returns the retained prefixes kept.

    With a journal of this device and region, only the extents it lists
    are scrubbed, and the retained prefixes it lists as ready are kept (their
    extents reserved, their files left; the caller verifies their checksums
    before serving them).  A prefix that was still being written is reclaimed
    like a session.  Without one (first start, state directory wiped, journal
    unreadable, or written for another device or region), nothing says
    which blocks hold an earlier session's KV cache, so the whole region
    is: a new session must never read bytes it did not write.
    """
    start, blocks = allocator.start_lba, allocator.nblocks
    always_zero = cfg.device.zero_freed == "always"
    here = {"path": dev.path, "kind": dev.kind, "lba_size": dev.lba_size, "region": [start, blocks]}
    trimmed = zeroed = reclaimed = 0
    unscrubbed: list[tuple[int, int]] = []
    whole_region = ""
    try:
        stale, retained, old_device = journal.load_stale()
    except ValueError as e:
        log.warning("%s; scrubbing the whole region [%d, %d) to be safe", e, start, start + blocks)
        stale, retained, old_device, whole_region = [], [], None, "unreadable_journal"
    if old_device is None:
        whole_region = whole_region or "no_journal"
    elif any(old_device.get(k) != here[k] for k in ("path", "lba_size", "region")):
        whole_region = "journal_of_another_device_or_region"
        if stale or retained:
            log.warning("the journal names sessions on %s; this instance uses %s: not scrubbing them",
                        old_device, here)
        stale, retained = [], []
    kept = [r for r in retained if r.state == READY and all(
        start <= s and s + n <= start + blocks for s, n in r.extents)]
    # a prefix still being written (or outside today's region) is reclaimed like a session: never served
    stale = stale + [SessionRecord(id=r.id, uid=-1, pid=-1, mode="retained", extents=r.extents,
                                   pagecache_dir=r.pagecache_dir) for r in retained if r not in kept]
    for rec in stale:
        for s, n in rec.extents:
            # only inside today's region: blocks outside it may have been given to someone else
            lo, hi = max(s, start), min(s + n, start + blocks)
            if hi - lo != n:
                log.warning("stale extent %d+%d of session %s is not inside the region [%d, %d); "
                            "scrubbing only the part inside", s, n, rec.id, start, start + blocks)
            if hi <= lo:
                continue
            # TRIM, plus Write Zeroes where the device does not read zeroes after it
            t, z, safe = scrub(dev, lo, hi - lo, always_zero=always_zero)
            trimmed, zeroed = trimmed + t, zeroed + z
            if not safe:
                log.error("stale extent %d+%d of session %s could be neither deallocated to zeroes nor "
                          "zeroed; keeping it out of use", lo, hi - lo, rec.id)
                unscrubbed.append((lo, hi - lo))
        reclaimed += 1
        event("session_reclaim", session=rec.id, uid=rec.uid, pid=rec.pid, extents=len(rec.extents),
              pagecache_dir=rec.pagecache_dir or "none")
    if whole_region:
        t0 = time.monotonic()
        # a deallocate of a whole namespace takes seconds, Write Zeroes of one may take minutes:
        # ask systemd for more than TimeoutStartSec (systemd >= 236)
        sd_notify(f"STATUS=scrubbing the region {start}+{blocks} ({whole_region})",
                  f"EXTEND_TIMEOUT_USEC={SCRUB_START_TIMEOUT_S * 1_000_000}")
        t, z, safe = scrub(dev, start, blocks, always_zero=always_zero)
        stats.add("region_scrubbed_bytes", blocks * dev.lba_size)
        event("region_scrub", reason=whole_region, region=f"{start}+{blocks}", trimmed_bytes=t,
              zeroed_bytes=z, seconds=f"{time.monotonic() - t0:.3f}")
        if not safe:
            raise ConfigError([f"device.path: {dev.path} can neither deallocate the region to zeroes nor "
                               f"Write-Zero it, and there is no journal saying which blocks hold earlier "
                               f"sessions' data ({whole_region}); refusing to serve it"], cfg.source)
    removed = sweep_pagecache(cfg.pagecache_dir, keep=[r.pagecache_dir for r in kept])
    stats.add("trimmed_bytes", trimmed)
    stats.add("zeroed_bytes", zeroed)
    stats.add("sessions_reclaimed", reclaimed)
    if reclaimed or removed or whole_region:
        event("reclaim", sessions=reclaimed, trimmed_bytes=trimmed, zeroed_bytes=zeroed,
              pagecache_dirs_removed=removed, whole_region_scrubbed=whole_region or "no")
    journal.reset(here, kept)
    for kept_rec in kept:
        for s, n in kept_rec.extents:
            allocator.reserve(s, n, owner=kept_rec.id)
    for lo, n in unscrubbed:
        # quarantined until a later start-up manages the scrub; the journal keeps it for that
        allocator.reserve(lo, n, owner=QUARANTINED)
        journal.add(SessionRecord(id=f"{QUARANTINED}-{lo}", uid=os.getuid(), pid=os.getpid(),
                                  mode=QUARANTINED, extents=[(lo, n)]))
        stats.add("quarantined_bytes", n * dev.lba_size)
    return kept


__all__ = ["SCRUB_START_TIMEOUT_S", "open_store_device", "reclaim", "scrub"]
