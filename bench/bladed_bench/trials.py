"""How the studies run their trials, in one place: the order configurations alternate in, and the envelope of
their JSON (the machine, its kernel and load, the git commit) written as they go.

Every study repeats its configurations and alternates them, so that what one run leaves behind (writeback, the
discards of the blocks it freed, a warm cache) does not always land on the same successor (docs/benchmarks.md):

* :func:`williams`: a row of a Williams Latin square (every configuration once in every position, and after every
  other once): the KV sweep's points in a round, the end-to-end study's sides at a limit;
* :func:`abba`: forwards, then backwards (A B, B A, ...): two sides, or the rounds of a repetition;
* :func:`rotated`: each repetition starts one later (A B C, B C A, ...).

A cold run starts from :func:`bladed_bench.cgroup.drop_caches` (``sync; echo 3 > /proc/sys/vm/drop_caches``).
The envelope: :func:`machine` (:func:`bladed_bench.environment.machine_info` with the load average at the start,
the disk and filesystem under the work directory, the commit), :func:`loadavg_end` when the study ends, and
:func:`write_json` to rewrite the JSON after every run, so that a study cut short keeps what it measured.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from bladed_bench import environment
from bladed_bench.metrics import block_device_of, reported_kib
from bladed_bench.repo import REPO

T = TypeVar("T")


# -- the order of the configurations -------------------------------------------------------------------------------

def williams(n: int, rep: int) -> list[int]:
    """Row ``rep`` of a Williams Latin square: over n repetitions every point runs once in every position
    and (n even) directly after every other point once, so what one run leaves behind (writeback, the
    discards of blocks it freed) does not always land on the same successor."""
    if n <= 1:
        return list(range(n))
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [(x + rep) % n for x in first]
    return row if (rep // n) % 2 == 0 else row[::-1]


def abba(items: Iterable[T], rep: int) -> list[T]:
    """``items`` in their order in an even repetition, backwards in an odd one."""
    out = list(items)
    return out if rep % 2 == 0 else out[::-1]


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """``items`` starting with item ``rep`` mod n."""
    k = rep % len(items) if items else 0
    return [*items[k:], *items[:k]]


# -- the envelope --------------------------------------------------------------------------------------------------

def machine(workdir: str | None, git_paths: Sequence[str]) -> dict[str, Any]:
    """The machine (:func:`bladed_bench.environment.machine_info`) and the commit of this checkout (``git_dirty``:
    tracked files under ``git_paths`` differ from it); with ``workdir``, the disk and filesystem under it and
    whether free page reporting is on."""
    git = environment.git_info(REPO, git_paths)
    out = environment.machine_info()
    if workdir is not None:
        out |= {"disk": environment.disk_info(block_device_of(workdir)),
                "filesystem": environment.filesystem_of(workdir)}
    out |= {"git_commit": git["commit"], "git_dirty": git["dirty"]}
    if workdir is not None:
        out["free_page_reporting"] = reported_kib() is not None
    return out


def loadavg_end(machine_record: dict[str, Any]) -> None:
    """The load average now, as ``loadavg_end`` beside the record's ``loadavg_start``."""
    machine_record["loadavg_end"] = environment.read_text("/proc/loadavg")


def write_json(path: str, doc: Any, *, default: Callable[[Any], Any] | None = None, newline: bool = False) -> None:
    """``doc`` as indented JSON at ``path``, replaced at once (a reader never sees half a file); ``newline``: with
    a line end after it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=default)
        if newline:
            f.write("\n")
    os.replace(tmp, path)


__all__ = ["abba", "loadavg_end", "machine", "rotated", "williams", "write_json"]
