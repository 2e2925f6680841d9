"""The studies' statistics, in one place: medians with their spread, percentiles and latencies, ratios paired
within a round, the runs that ended, sizes on the command line and in tables.

Every benchmark repeats its measurements and reports the median with the range (min-max) over the
repetitions; comparisons are ratios of runs paired in the same round (the same repetition and limit), not
ratios of medians (docs/benchmarks.md). Where two studies' versions differed, the difference is a parameter
here, so that no study's results changed when it moved here.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from bladed import config as daemon_config

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


# -- medians with their spread -------------------------------------------------------------------------------------

def summarize(values: Iterable[float | None], *, keep_values: bool = False,
              skip_missing: bool = True) -> dict[str, Any]:
    """Median with min, max and relative spread ((max - min) / median) of repeated measurements.

    ``skip_missing``: leave out ``None`` and NaN (and count the rest as floats); without it the values are taken
    as they are (the engine study's MB/s). ``keep_values``: the values too, under ``values``."""
    vals: list[Any] = ([float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
                       if skip_missing else list(values))
    if not vals:
        empty: dict[str, Any] = {"n": 0, "median": None, "min": None, "max": None, "spread_pct": None}
        return empty | {"values": []} if keep_values else empty
    med = statistics.median(vals)
    out = {"n": len(vals), "median": med, "min": min(vals), "max": max(vals),
           "spread_pct": 100.0 * (max(vals) - min(vals)) / med if med else None}
    if keep_values:
        out["values"] = vals
    return out


def median(values: Iterable[float | None], default: Any = None) -> Any:
    """The median of the values that are not ``None``; ``default`` if there are none."""
    xs = [x for x in values if x is not None]
    return statistics.median(xs) if xs else default


def median_range(values: Iterable[float | None], *, count: bool = True) -> dict[str, float] | None:
    """``{median, min, max, n}`` of the values that are not ``None`` (without ``n`` unless ``count``); ``None`` if
    there are none."""
    xs = [x for x in values if x is not None]
    if not xs:
        return None
    out = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return out | {"n": len(xs)} if count else out


def fmt(s: dict[str, Any] | None, digits: int = 2, scale: float = 1.0, spread: bool = True) -> str:
    """``median [min-max]`` of :func:`summarize` or :func:`median_range` (the median alone for one value or
    without ``spread``; ``-`` for none)."""
    if not s or s.get("median") is None:
        return "-"
    m = s["median"] * scale
    if not spread or s["n"] < 2:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f}]"


# -- percentiles and latencies -------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100)."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def latency_stats(values_s: Sequence[float]) -> dict[str, Any]:
    """avg / p50 / p99 / max in milliseconds."""
    if not values_s:
        return {"n": 0, "avg_ms": None, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ms = [v * 1e3 for v in values_s]
    return {"n": len(ms), "avg_ms": statistics.fmean(ms), "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99), "max_ms": max(ms)}


# -- runs and pairs ------------------------------------------------------------------------------------------------

def ok_runs(doc: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    """The runs of a study's JSON that ended (no ``error``) whose fields equal ``match`` (``kv_format=None``:
    the runs without a KV format)."""
    return [r for r in doc["runs"] if "error" not in r and all(r.get(k) == v for k, v in match.items())]


def paired(runs: Iterable[dict[str, Any]], a: str, b: str | Callable[[dict[str, dict[str, Any]]], float | None], *,
           name: Callable[[dict[str, Any]], str], group: Callable[[dict[str, Any]], Hashable],
           value: Callable[[dict[str, Any]], float | None]) -> dict[Any, list[float]]:
    """Per group (sorted; a group: the runs of one round, the same repetition and limit): ``value`` of the run
    ``name``d ``a`` over that of the one named ``b``, or over ``b(runs of the group by name)``. A group
    without ``a``, or whose ``a`` has no value, or whose denominator is missing or zero, gives nothing."""
    groups: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(group(r), {})[name(r)] = r
    out: dict[Any, list[float]] = {}
    for key in sorted(groups, key=lambda k: (k is None, k)):
        by = groups[key]
        if a not in by:
            continue
        den = b(by) if callable(b) else (value(by[b]) if b in by else None)
        num = value(by[a])
        if num is not None and den:
            out.setdefault(key, []).append(num / den)
    return out


# -- sizes ---------------------------------------------------------------------------------------------------------

def parse_size(text: str, *, fractions: bool = False, unit: int = 1, zero: bool = False) -> int:
    """A size on the command line, in bytes (binary units; ``argparse.ArgumentTypeError`` if it is not one).

    By default a whole positive number (``zero``: or 0) with K, M, G, T or P, with or without B or iB, as the
    daemon's configuration reads it (:func:`bladed.config.parse_size`): ``4096``, ``128K``, ``1GiB``.
    ``fractions`` (the KV sweep's): a number that may have a fraction and K, M or G, zero allowed: ``1.5G``; a
    bare number counts in ``unit`` (the copy-limit study's ``--size 1.5``: GiB)."""
    if fractions:
        t = text.strip().upper().removesuffix("B").removesuffix("I")
        mult = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], unit)
        num = t[:-1] if t[-1:] in "KMG" else t
        try:
            return int(float(num) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 512M)") from None
    try:
        value = daemon_config.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 128K, 1M, 1G)") from None
    if value <= 0 and not zero:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def human_size(n: int) -> str:
    """Bytes as the shortest exact binary unit: 131072 -> ``128K``."""
    for unit, scale in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


__all__ = ["GiB", "KiB", "MiB", "TiB", "fmt", "human_size", "latency_stats", "median", "median_range", "ok_runs",
           "paired", "parse_size", "percentile", "summarize"]
