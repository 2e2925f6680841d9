"""The non-destructive checks of ``bladectl ns check`` / ``ns setup``: can bladed use a store?

One function per check; :func:`run_checks` runs those that apply to the backend, in the
order they are reported, and stops at the first check that leaves nothing more to test
(no such store file possible, no access, the store does not open).  The kernel features are
probed (:mod:`bladed.io.features`), not read off the version: one that is missing is a
warning naming what bladed does instead.
"""

from __future__ import annotations

import errno
import os
import platform
import resource
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bladed.cli.storage import partition_offset
from bladed.config import Config, format_size, region_of
from bladed.config import validate_device as config_device_problems
from bladed.io import engines, features
from bladed.residency.damon import pageout_schemes

if TYPE_CHECKING:
    from bladed.io import ExtentDevice


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "detail": self.detail}


def run_checks(path: str, backend: str, *, size_bytes: int = 0, region_start: int = 0,
               region_blocks: int = 0) -> list[Check]:
    """Can bladed use ``path`` as ``backend``?  Non-destructive: opens it and reads one block.

    Call :func:`bladed.cli.storage.target_backend` and :func:`bladed.cli.storage.in_use` first:
    this assumes ``path`` is a free store of ``backend`` (or a store file to create).
    """
    out = [_kernel(backend), *(_feature(f) for f in _features(backend)), _memlock(), _host_pageout()]
    if backend == "file" and not os.path.exists(path):
        return out + _new_store_file(path, size_bytes)
    return out + _existing_store(path, backend, region_start, region_blocks)


# -- the kernel and the process ---------------------------------------------------------------
def _features(backend: str) -> list[features.Feature]:
    """The features the backend's I/O depends on, in the order they are shown."""
    out = [features.io_uring()]
    if backend == "nvme":
        out += [features.io_uring_cmd(), features.nvme_generic_chardev()]
    if backend == "block":
        out.append(features.io_uring_discard())
    out.append(features.cachestat())
    return out


def _kernel(backend: str) -> Check:
    """The kernel, and the engine ``io.engine = "auto"`` picks for the backend here."""
    choice = engines.choose(engines.AUTO, backend)
    return Check("kernel", "ok", f"{platform.release()}; {backend} backend on the {choice.engine} engine "
                                 f"with io.engine = auto ({choice.reason})")


def _feature(f: features.Feature) -> Check:
    """One probed feature: ok, or a warning naming the fallback (every missing feature has one)."""
    return Check(f.name, "ok" if f.available else "warn", f.describe())


def _memlock() -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    root = os.geteuid() == 0
    return Check("memlock", "ok" if root or soft == resource.RLIM_INFINITY or soft >= 64 << 20 else "warn",
                 f"RLIMIT_MEMLOCK {'unlimited' if soft == resource.RLIM_INFINITY else format_size(soft)}"
                 + ("; running as root (CAP_IPC_LOCK)" if root else
                    "; fixed-buffer registration may fail (LimitMEMLOCK=infinity in the unit)"))


def _host_pageout() -> Check:
    schemes = pageout_schemes()
    return Check("host page-out", "warn" if schemes else "ok",
                 "; ".join(s.describe() for s in schemes)
                 + ": page-cache KV idle that long is read back from the store, whatever the budget"
                 if schemes else "no DAMON pageout scheme: page-cache KV stays until the budget evicts it")


# -- a store file to create -------------------------------------------------------------------
def _new_store_file(path: str, size_bytes: int) -> list[Check]:
    parent = os.path.dirname(os.path.abspath(path))
    ok = os.path.isdir(parent) and os.access(parent, os.W_OK)
    creatable = Check("exists", "ok" if ok else "fail",
                      f"{path} will be created ({format_size(size_bytes)})" if ok
                      else f"{path} does not exist and {parent} is not a writable directory")
    return [creatable, _o_direct(parent)] if ok else [creatable]


def _o_direct(directory: str) -> Check:
    fd, probe_path = tempfile.mkstemp(dir=directory, prefix=".bladed-probe-")
    os.close(fd)
    try:
        pfd = os.open(probe_path, os.O_RDWR | os.O_DIRECT)
        os.close(pfd)
        return Check("O_DIRECT", "ok", f"the filesystem of {directory} supports O_DIRECT")
    except OSError as e:
        return Check("O_DIRECT", "fail", f"the filesystem of {directory} refuses O_DIRECT ({e.strerror})")
    finally:
        os.unlink(probe_path)


# -- an existing store ------------------------------------------------------------------------
def _existing_store(path: str, backend: str, region_start: int, region_blocks: int) -> list[Check]:
    out = [Check("exists", "ok", f"{path} ({backend})")]
    if not os.access(path, os.R_OK | os.W_OK):
        return [*out, Check("permissions", "fail", f"no read-write access to {path} for uid {os.geteuid()}")]
    dev = _open(path, backend)
    if isinstance(dev, Check):
        return [*out, dev]
    with dev:
        out.append(Check("permissions", "ok", f"opened {path} read-write"
                         + (" exclusively" if backend == "block" else "")))
        out.append(_lba_size(dev))
        region, start = _region(dev, path, region_start, region_blocks)
        out.append(region)
        if backend == "block":
            out += [_alignment(dev), _discard(dev)]
        if backend == "nvme":
            out += [_mdts(dev), _deallocate(dev), _fixed_buffers(dev)]
        out.append(_read_one_block(dev, start))
    return out


def _open(path: str, backend: str) -> ExtentDevice | Check:
    """The open device, or the failed "open read-write" check."""
    from bladed.io import open_device

    opts: dict[str, Any] = {"create": False} if backend == "file" else {}
    try:
        return open_device(backend, path, **opts)
    except OSError as e:
        why = f"cannot open {path} read-write: {e.strerror or e}"
        if e.errno == errno.EBUSY:
            why = f"{path} is in use (mounted, or claimed by another process)"
        elif e.errno in (errno.EPERM, errno.EACCES):
            why = (f"no permission to open {path} read-write ({e.strerror}); run as root, or let this user in "
                   "(udev rule, device cgroup / DeviceAllow=)")
        return Check("open read-write", "fail", why)
    except ValueError as e:
        return Check("open read-write", "fail", str(e))


def _lba_size(dev: ExtentDevice) -> Check:
    lba = dev.lba_size
    return Check("LBA size", "ok" if lba == 4096 else "warn",
                 f"{lba} bytes" + ("" if lba == 4096 else
                                   "; 4 KiB is what the paper's alignment precondition assumes "
                                   "(bladectl ns setup --format-lba 4096 for NVMe)"))


def _region(dev: ExtentDevice, path: str, region_start: int, region_blocks: int) -> tuple[Check, int]:
    """The region check, and the region's first LBA."""
    cfg = Config()
    cfg.device.region_start_lba, cfg.device.region_blocks = region_start, region_blocks
    problems = config_device_problems(cfg, lba_size=dev.lba_size, capacity_blocks=dev.capacity_blocks, path=path)
    start, blocks = region_of(cfg, dev.capacity_blocks)
    return Check("region", "fail" if problems or blocks <= 0 else "ok",
                 "; ".join(problems) or f"LBA {start} + {blocks} blocks = {format_size(blocks * dev.lba_size)} of "
                                        f"{format_size(dev.capacity_bytes)}"), start


def _alignment(dev: ExtentDevice) -> Check:
    align = partition_offset(dev.fd)
    return Check("alignment", "ok" if align % (1 << 20) == 0 else "warn",
                 f"starts at byte {align} of its disk" + ("" if align % (1 << 20) == 0 else ": not 1 MiB aligned"))


def _discard(dev: ExtentDevice) -> Check:
    discard = getattr(dev, "discard_max_bytes", 0)
    return Check("discard", "ok" if discard else "warn",
                 f"discard_max_bytes {discard}" + ("" if discard else ": TRIM on teardown is a no-op"))


def _mdts(dev: ExtentDevice) -> Check:
    ident = dev.identity  # type: ignore[attr-defined]
    return Check("MDTS", "ok", f"MDTS {ident.mdts} ({format_size(ident.mdts_bytes) if ident.mdts else 'no'}"
                               f" limit); per command {format_size(dev.max_transfer_bytes)}")


def _deallocate(dev: ExtentDevice) -> Check:
    ident = dev.identity  # type: ignore[attr-defined]
    return Check("deallocate", "ok" if ident.deallocate_reads_zeroes else "warn",
                 f"DLFEAT {ident.dlfeat & 7}: deallocated blocks read "
                 + ("zeroes" if ident.deallocate_reads_zeroes else "undefined or ones"))


def _fixed_buffers(dev: ExtentDevice) -> Check:
    """Registered staging buffers for passthrough, probed with a one-block read (NvmeDevice.fixed_buffers_supported)."""
    if dev.engine != engines.URING:
        return Check("fixed buffers", "ok", f"{dev.engine} engine: staging buffers are passed by address")
    ok = dev.fixed_buffers_supported()  # type: ignore[attr-defined]
    return Check("fixed buffers", "ok" if ok else "warn",
                 "registered staging buffers work for passthrough" if ok else
                 "the kernel refuses passthrough from a registered buffer longer than max_segments pages "
                 "(Linux 6.1): such staging buffers are used unregistered")


def _read_one_block(dev: ExtentDevice, start: int) -> Check:
    from bladed.io import Engine, StagingBuffer

    lba = dev.lba_size
    try:
        buf = StagingBuffer(max(lba, 4096))
        with Engine(dev, 2, [buf]) as eng:
            x = eng.read(start, buf, nbytes=lba)
        buf.close()
        return Check("read", "ok", f"read LBA {start} on the {dev.engine} engine in {x.service_ns / 1e3:.0f} us")
    except OSError as e:
        return Check("read", "fail", f"reading LBA {start} failed: {e}")
