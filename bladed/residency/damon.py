"""Reclaim the host runs outside every memory cgroup: DAMON ``pageout`` schemes.

Eq. 1-2 size the page-cache budget from the memory cgroup and the host's free memory.  A kernel
can also run DAMON (``/sys/kernel/mm/damon/admin``) with a ``pageout`` scheme on physical memory:
every page in its range that has gone unaccessed for the scheme's minimum age is reclaimed, however
far below its limit the cgroup is.  Some VM hosts set one up at boot to hand idle guest memory
back: the 2026-11-26 build VM's pages out unmapped page cache idle for 60 s, so an idle session's
page-cache KV (bladed's page-cache path uses ``pread``/``pwrite``: unmapped) went at 15-17 MB/s
while ``mmap``ed KV stayed (docs/benchmarks.md).  bladed cannot change the host's policy; it
reports it (``bladectl ns check``, the benchmarks' machine record) so that a hit ratio below what
the budget promises has a named cause.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DAMON_ADMIN = "/sys/kernel/mm/damon/admin"


@dataclass(frozen=True)
class PageoutScheme:
    """One running DAMON scheme that pages out physical memory."""

    kdamond: int
    ranges: tuple[tuple[int, int], ...]  # physical address ranges it watches, [start, end)
    min_idle_s: float                     # access_pattern/age/min x the aggregation interval
    quota_bytes_per_s: float | None      # quotas/bytes per reset interval; None: no size quota
    filters: tuple[str, ...] = ()         # "allow unmapped", "reject anon", ... in the order they apply

    def describe(self) -> str:
        span = ", ".join(f"{s / 2**30:.1f}-{e / 2**30:.1f} GiB" for s, e in self.ranges) or "all memory"
        quota = f", at most {self.quota_bytes_per_s / 2**20:.0f} MiB/s" if self.quota_bytes_per_s else ""
        filters = f"; {', '.join(self.filters)}" if self.filters else ""
        return f"kdamond {self.kdamond} pages out memory idle for {self.min_idle_s:g} s ({span}{quota}{filters})"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int(path: str) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _entries(directory: str) -> list[str]:
    """The numbered subdirectories of a DAMON sysfs list (``0``, ``1``, ...), in order."""
    try:
        return sorted((e for e in os.listdir(directory) if e.isdigit()), key=int)
    except OSError:
        return []


def _filters(scheme: str) -> tuple[str, ...]:
    """The scheme's DAMOS filters (``core_filters``, ``ops_filters``, and the older ``filters``) as words."""
    out = []
    for group in ("core_filters", "ops_filters", "filters"):
        for f in _entries(os.path.join(scheme, group)):
            path = os.path.join(scheme, group, f)
            kind = _read(os.path.join(path, "type")) or "?"
            if kind == "memcg":
                kind = f"memcg {_read(os.path.join(path, 'memcg_path')) or '?'}"
            negate = "" if _read(os.path.join(path, "matching")) != "N" else "not "
            # 6.14+ name the verdict "allow"; before it, every filter rejected what it matched
            verdict = "allow" if _read(os.path.join(path, "allow")) == "Y" else "reject"
            out.append(f"{verdict} {negate}{kind}")
    return tuple(out)


def pageout_schemes(root: str = DAMON_ADMIN) -> list[PageoutScheme]:
    """The running kdamonds' ``pageout`` schemes on physical memory; [] without DAMON or without access."""
    found = []
    kdamonds = os.path.join(root, "kdamonds")
    for k in _entries(kdamonds):
        kd = os.path.join(kdamonds, k)
        if _read(os.path.join(kd, "state")) != "on":
            continue
        for c in _entries(os.path.join(kd, "contexts")):
            ctx = os.path.join(kd, "contexts", c)
            if _read(os.path.join(ctx, "operations")) != "paddr":
                continue  # vaddr schemes page out named processes' memory, not the page cache
            aggr_us = _int(os.path.join(ctx, "monitoring_attrs", "intervals", "aggr_us")) or 0
            ranges = []
            for t in _entries(os.path.join(ctx, "targets")):
                regions = os.path.join(ctx, "targets", t, "regions")
                for r in _entries(regions):
                    start = _int(os.path.join(regions, r, "start"))
                    end = _int(os.path.join(regions, r, "end"))
                    if start is not None and end is not None:
                        ranges.append((start, end))
            for s in _entries(os.path.join(ctx, "schemes")):
                scheme = os.path.join(ctx, "schemes", s)
                if _read(os.path.join(scheme, "action")) != "pageout":
                    continue
                age = _int(os.path.join(scheme, "access_pattern", "age", "min")) or 0
                quota = _int(os.path.join(scheme, "quotas", "bytes")) or 0
                reset_ms = _int(os.path.join(scheme, "quotas", "reset_interval_ms")) or 0
                found.append(PageoutScheme(
                    kdamond=int(k), ranges=tuple(ranges), min_idle_s=age * aggr_us / 1e6,
                    quota_bytes_per_s=quota * 1000 / reset_ms if quota and reset_ms else None,
                    filters=_filters(scheme)))
    return found
