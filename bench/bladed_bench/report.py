"""From a sweep's JSON to tables (Markdown) and plots (matplotlib PNGs).

Everything shown is computed from the run records and round probes in the
JSON: medians over repetitions with their min-max spread.  A hand-written
analysis between ``<!-- analysis:begin -->`` and ``<!-- analysis:end -->`` in
an existing report is kept when the report is regenerated.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from bladed_bench import stats
from bladed_bench.stats import fmt, summarize
from bladed_bench.workload import CONFIGS, LABELS

GiB = 1 << 30
ANALYSIS_RE = re.compile(r"<!-- analysis:begin -->.*?<!-- analysis:end -->", re.S)
COLORS = {"baseline": "tab:red", "cachepolicy": "tab:orange", "direct": "tab:blue", "dualblade": "tab:green"}
MARKERS = {"baseline": "o", "cachepolicy": "s", "direct": "^", "dualblade": "D"}


# -- loading and selecting ---------------------------------------------------------------------

def load(paths: Iterable[str]) -> dict[str, Any]:
    """One document from one or more sweep JSONs (runs and rounds concatenated)."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    if not docs:
        raise ValueError("no input")
    out = dict(docs[0])
    out["sources"] = [os.path.basename(p) for p in paths]
    out["rounds"], out["runs"] = [], []
    for d in docs:
        off = len(out["rounds"])
        out["rounds"].extend(d.get("rounds", []))
        for r in d.get("runs", []):
            r = dict(r)
            if "round" in r:
                r["round"] += off
            out["runs"].append(r)
    return out


def study_runs(doc: dict[str, Any], study: str | None = None, config: str | None = None,
            pipeline: str | None = None, kv_format: str | None = None) -> list[dict[str, Any]]:
    """The runs that ended (:func:`~bladed_bench.stats.ok_runs`) of one study / config / pipeline; of plain rows
    unless ``kv_format`` names one (the paper's figures compare plain rows; the formats have their own table)."""
    match = {k: v for k, v in (("study", study), ("config", config), ("pipeline", pipeline)) if v is not None}
    return stats.ok_runs(doc, **match, kv_format=kv_format)


def run_name(r: dict[str, Any]) -> str:
    """``dualblade``, ``dualblade-q8``: the configuration as ``--configs`` names it."""
    return r["config"] + (f"-{r['kv_format']}" if r.get("kv_format") else "")


def by_key(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(key(r), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0])))


def get(r: dict[str, Any], dotted: str) -> Any:
    cur: Any = r
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def med(runs: list[dict[str, Any]], field: str | Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """:func:`~bladed_bench.stats.summarize` of a field (dotted: ``bytes.decode_read``) or of a function of
    each run."""
    fn = field if callable(field) else (lambda r: get(r, field))
    return summarize(fn(r) for r in runs)


def gib(n: int | float | None) -> str:
    return "none" if n is None else f"{n / GiB:.2f}"


# -- derived quantities --------------------------------------------------------------------------

def round_of(doc: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    i = r.get("round")
    return doc["rounds"][i] if isinstance(i, int) and 0 <= i < len(doc["rounds"]) else {}


def bw_dev(doc: dict[str, Any], r: dict[str, Any], op: str = "read") -> float | None:
    return get(round_of(doc, r), f"fio.{op}_GBps")


def bw_pc(doc: dict[str, Any], r: dict[str, Any]) -> float | None:
    return get(round_of(doc, r), "pagecache.GBps")


def t_ideal(doc: dict[str, Any], r: dict[str, Any], pooled: bool = False) -> float | None:
    """``sum over decode steps of bytes_G1 / BW_pc + bytes_G2 / BW_dev`` with this round's bandwidths
    (``pooled``: with the medians of every round of the sweep)."""
    if pooled:
        pc = summarize(get(x, "pagecache.GBps") for x in doc["rounds"])["median"]
        dev = summarize(get(x, "fio.read_GBps") for x in doc["rounds"])["median"]
    else:
        pc, dev = bw_pc(doc, r), bw_dev(doc, r)
    steps = get(r, "bytes.decode_read_per_step")
    if not pc or not dev or not steps:
        return None
    return sum(s["g1"] / (pc * 1e9) + s["g2"] / (dev * 1e9) for s in steps.values())


def ideal_ratio(doc: dict[str, Any], r: dict[str, Any], pooled: bool = False) -> float | None:
    t = t_ideal(doc, r, pooled)
    return r["decode_s"] / t if t else None


def fits_fraction(doc: dict[str, Any], limit: int | None) -> float | None:
    """min(1, B_pc / KV) with the B_pc the daemon computed at this limit (Dual-Blade runs)."""
    kv = doc["workload"]["kv_bytes"]
    vals = [get(r, "target.plan.budget_bytes") for r in study_runs(doc, "sweep", "dualblade")
            if r["limit_bytes"] == limit]
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return min(1.0, statistics.median(vals) / kv)


def group1_fraction(doc: dict[str, Any], limit: int | None) -> float | None:
    kv = doc["workload"]["kv_bytes"]
    vals = [get(r, "target.plan.group1_bytes") for r in study_runs(doc, "sweep", "dualblade")
            if r["limit_bytes"] == limit]
    vals = [v for v in vals if v is not None]
    return min(1.0, statistics.median(vals) / kv) if vals else None


def paired_by_limit(doc: dict[str, Any], study: str, a: str,
                    b: str | Callable[[dict[str, dict[str, Any]]], float | None], field: str = "decode_s",
                    pipeline: str | None = None) -> dict[Any, list[float]]:
    """Per limit: ratios a/b of runs from the same round (same repetition and limit)."""
    out: dict[Any, list[float]] = {}
    runs = [r for r in study_runs(doc, study) if pipeline is None or r["pipeline"] == pipeline]
    by_round = stats.paired(runs, a, b, name=lambda r: r["config"], group=lambda r: (r.get("round"), r["limit_bytes"]),
                            value=lambda r: get(r, field))
    for (_rnd, lim), xs in by_round.items():
        out.setdefault(lim, []).extend(xs)
    return out


# -- plots ---------------------------------------------------------------------------------------

def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _errbar(ax: Any, xs: list[float], stats: list[dict[str, Any]], cfg: str, scale: float = 1.0) -> None:
    pts = [(x, s) for x, s in zip(xs, stats, strict=True) if s.get("median") is not None]
    if not pts:
        return
    x = [p[0] for p in pts]
    y = [p[1]["median"] * scale for p in pts]
    lo = [max(0.0, (p[1]["median"] - p[1]["min"]) * scale) for p in pts]
    hi = [max(0.0, (p[1]["max"] - p[1]["median"]) * scale) for p in pts]
    ax.errorbar(x, y, yerr=[lo, hi], label=LABELS[cfg], color=COLORS[cfg], marker=MARKERS[cfg], capsize=3)


def _save(plt: Any, fig: Any, path: str) -> None:
    """Lay out, write the PNG and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fig3(doc: dict[str, Any], path: str) -> None:
    plt = _plt()
    runs = by_key(study_runs(doc, "sweep", "baseline"), lambda r: r["limit_bytes"])
    xs = [lim / GiB for lim in runs if lim]
    rs = [runs[lim] for lim in runs if lim]
    kv = doc["workload"]["kv_bytes"] / GiB
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for field, name, color in (("prefill_s", "prefill", "tab:purple"), ("decode_s", "decode", "tab:red")):
        st = [med(r, field) for r in rs]
        a.errorbar(xs, [s["median"] for s in st], yerr=[[s["median"] - s["min"] for s in st],
                                                          [s["max"] - s["median"] for s in st]],
                   label=f"Baseline {name}", marker="o", color=color, capsize=3)
    a.axvline(kv, ls=":", color="gray", label=f"KV set {kv:.2f} GiB")
    a.set_xlabel("memory limit (GiB)")
    a.set_ylabel("latency (s)")
    a.set_title("(a) Baseline latency vs memory limit")
    a.legend()
    hit = [med(r, "hit_ratio") for r in rs]
    b.plot(xs, [s["median"] * 100 for s in hit], marker="o", color="tab:red", label="decode hit ratio")
    b.set_ylim(-3, 103)
    b.set_ylabel("page-cache hit ratio (%)")
    b.set_xlabel("memory limit (GiB)")
    b2 = b.twinx()
    pc = [med(r, "cgroup.page_cache_decode_median") for r in rs]
    b2.plot(xs, [(s["median"] or 0) / GiB for s in pc], marker="s", ls="--", color="tab:gray",
            label="page cache in use (decode)")
    b2.set_ylabel("page cache charged to the cgroup (GiB)")
    b.axvline(kv, ls=":", color="gray")
    b.set_title("(b) Baseline hit ratio and page cache")
    h1, l1 = b.get_legend_handles_labels()
    h2, l2 = b2.get_legend_handles_labels()
    b.legend(h1 + h2, l1 + l2, loc="center right")
    _save(plt, fig, path)


def plot_fig10(doc: dict[str, Any], path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    kv = doc["workload"]["kv_bytes"] / GiB
    for ax, field, title in ((axes[0], "prefill_s", "(a) prefill latency"), (axes[1], "decode_s",
                                                                             "(b) decode latency")):
        for cfg in CONFIGS:
            runs = by_key(study_runs(doc, "sweep", cfg), lambda r: r["limit_bytes"])
            lims = [lim for lim in runs if lim]
            _errbar(ax, [lim / GiB for lim in lims], [med(runs[lim], field) for lim in lims], cfg)
        ax.axvline(kv, ls=":", color="gray")
        ax.set_xlabel("memory limit (GiB)")
        ax.set_ylabel("latency (s)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_fig11(doc: dict[str, Any], path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lims_all: list[int] = []
    for cfg in CONFIGS:
        runs = by_key(study_runs(doc, "sweep", cfg), lambda r: r["limit_bytes"])
        lims = [lim for lim in runs if lim]
        lims_all = sorted(set(lims_all) | set(lims))
        _errbar(ax, [lim / GiB for lim in lims], [med(runs[lim], "hit_ratio") for lim in lims], cfg, 100.0)
    fits: list[tuple[float, float]] = []
    for lim in lims_all:
        f = fits_fraction(doc, lim)
        if f is not None:
            fits.append((lim / GiB, f))
    if fits:
        ax.plot([x for x, _ in fits], [f * 100 for _, f in fits], ls=":", color="black",
                label="KV fraction within B_pc")
    ax.set_xlabel("memory limit (GiB)")
    ax.set_ylabel("decode page-cache hit ratio (%)")
    ax.set_ylim(-3, 103)
    ax.set_title("Page-cache hit ratio in decode")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def representative(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run with the median decode time among those that kept a time series."""
    rs = sorted([r for r in runs if "series" in r], key=lambda r: r["decode_s"])
    return rs[len(rs) // 2] if rs else None


def plot_fig12(doc: dict[str, Any], path: str, limit: int | None) -> None:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    fio_w = summarize(get(x, "fio.write_GBps") for x in doc["rounds"])
    fio_r = summarize(get(x, "fio.read_GBps") for x in doc["rounds"])
    for cfg in CONFIGS:
        r = representative([x for x in study_runs(doc, "sweep", cfg) if x["limit_bytes"] == limit])
        if r is None:
            continue
        s = r["series"]
        t, rd, wr = s["t"], s["read_GBps"], s["write_GBps"]
        pe, ds = s["prefill_end"], s["decode_start"]
        a.plot([x for x in t if x <= pe + 0.5], [w for x, w in zip(t, wr, strict=True) if x <= pe + 0.5],
               color=COLORS[cfg], label=LABELS[cfg])
        b.plot([x - ds for x in t if x >= ds], [v for x, v in zip(t, rd, strict=True) if x >= ds],
               color=COLORS[cfg], label=LABELS[cfg])
    if fio_w["median"]:
        a.axhline(fio_w["median"], ls="--", color="black", label=f"fio seq write {fio_w['median']:.2f}")
    if fio_r["median"]:
        b.axhline(fio_r["median"], ls="--", color="black", label=f"fio seq read {fio_r['median']:.2f}")
    a.set_title(f"(a) prefill write, limit {gib(limit)} GiB")
    b.set_title(f"(b) decode read, limit {gib(limit)} GiB")
    for ax in (a, b):
        ax.set_xlabel("time (s)")
        ax.set_ylabel("device throughput (GB/s, /sys/block stat)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_table5(doc: dict[str, Any], path: str) -> None:
    plt = _plt()
    runs = study_runs(doc, "alpha")
    if not runs:
        return
    alphas = sorted({r["alpha"] for r in runs})
    pls = sorted({r["pipeline"] for r in runs}, key=lambda p: p != "off")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    w = 0.8 / max(1, len(pls))
    for i, pl in enumerate(pls):
        st = [med([r for r in runs if r["alpha"] == a and r["pipeline"] == pl], "decode_s") for a in alphas]
        xs = [j + i * w for j in range(len(alphas))]
        ax.bar(xs, [s["median"] or 0 for s in st], width=w, label=f"Dual-Blade, pipeline {pl}",
               yerr=[[(s["median"] or 0) - (s["min"] or 0) for s in st],
                     [(s["max"] or 0) - (s["median"] or 0) for s in st]], capsize=3)
    ax.set_xticks([j + w * (len(pls) - 1) / 2 for j in range(len(alphas))], [f"alpha={a}" for a in alphas])
    ax.set_ylabel("decode latency (s)")
    ax.set_title("Dual-Blade decode latency with and without P·P")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


# -- Markdown ------------------------------------------------------------------------------------

def dma_text(doc: dict[str, Any]) -> str:
    """How each study treated the staging slot <-> GPU copies."""
    w = doc["workload"]
    what = {"none": "none (pure KV I/O: T_ideal's model)", "model": f"modelled as nbytes / {w['dma_gbps']} GB/s "
            "under one lock (one GPU copy engine)", "copy": "a real host memcpy"}
    per: dict[str, set[str]] = {}
    for r in doc["runs"]:
        per.setdefault(r.get("study", "?"), set()).add(r.get("dma") or w["dma"])
    parts = [f"{study}: {', '.join(what.get(d, d) for d in sorted(ds))}" for study, ds in sorted(per.items())]
    return "slot<->GPU DMA per study: " + "; ".join(parts)


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def sweep_limits(doc: dict[str, Any]) -> list[int]:
    """The memory limits of the main sweep, lowest first (no unlimited point)."""
    return sorted({r["limit_bytes"] for r in study_runs(doc, "sweep") if r["limit_bytes"]})


def _cell(doc: dict[str, Any], cfg: str, lim: int, field: str, digits: int = 2, scale: float = 1.0) -> str:
    """``median [min-max]`` of ``field`` over the main sweep's runs of ``cfg`` at ``lim``."""
    rs = [r for r in study_runs(doc, "sweep", cfg) if r["limit_bytes"] == lim]
    return fmt(med(rs, field), digits, scale)


def header_lines(doc: dict[str, Any], title: str) -> list[str]:
    """Title, source, machine, workload, and the device ceilings measured in the sweep."""
    m, w = doc["machine"], doc["workload"]
    kv = w["kv_bytes"]
    fio_r = summarize(get(x, "fio.read_GBps") for x in doc["rounds"])
    fio_w = summarize(get(x, "fio.write_GBps") for x in doc["rounds"])
    pc = summarize(get(x, "pagecache.GBps") for x in doc["rounds"])
    nerr = sum(1 for r in doc["runs"] if "error" in r)
    verr = sum(get(r, "verify.errors") or 0 for r in study_runs(doc))
    vchk = sum(get(r, "verify.checked") or 0 for r in study_runs(doc))
    L: list[str] = [f"# {title}", ""]
    L.append(f"Source: {', '.join('`' + s + '`' for s in doc.get('sources', []))} "
             f"(schema `{doc.get('schema')}`), started {doc['date']}, wall time "
             f"{(doc.get('wall_s') or 0) / 60:.1f} min.")
    L.append("")
    L.append(f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), {gib(m.get('memory_bytes'))} GiB, "
             f"{m.get('os')}, kernel {m.get('kernel')}, {m.get('fio')}; KV store and page-cache files on "
             f"{get(m, 'filesystem.fstype')} on {get(m, 'filesystem.source')} "
             f"(scheduler `{get(m, 'disk.scheduler')}`); git {str(m.get('git_commit'))[:12]}. "
             f"Load average at start / end: {m.get('loadavg_start')} / {m.get('loadavg_end')}.")
    L.append("")
    L.append(f"Workload: OPT-6.7B layer shape (L={w['layers']}, H={w['kv_heads']}, D={w['head_dim']}, "
             f"{8 * w['dtype_bytes']}-bit), batch {w['batch']}, prompt {w['prompt_len']}, gen_len {w['gen_len']} "
             f"({w['gen_len'] - 1} decode steps): KPU {w['kpu_bytes'] / 2**20:.1f} MiB, one-token append "
             f"{w['token_bytes'] // 1024} KiB, KV set **{kv / GiB:.2f} GiB** ({kv / 2**20:.1f} MiB). "
             f"Two copy threads/channels; "
             f"pipeline `{doc['plan']['points'][0]['pipeline'] if doc['plan']['points'] else '?'}` in the main "
             f"sweep; per-layer compute {w['compute_ms']} ms (decode) / {w['prefill_compute_ms']} ms (prefill); "
             + dma_text(doc) + ". Every run cold (caches dropped, fresh cgroup, fresh server process)"
             + ("" if doc["plan"].get("cold_runs") else " **(not: caches could not be dropped)**") + f"; "
             f"{doc['plan']['reps']} repetitions, configurations alternated. Figures are medians with "
             f"[min-max] over the repetitions.")
    L.append("")
    L.append(f"Device ceilings measured in the same sweep (one per round, {fio_r['n']} rounds): fio sequential "
             f"read **{fmt(fio_r)} GB/s**, write **{fmt(fio_w)} GB/s** (O_DIRECT, io_uring, 1 MiB, QD 32); "
             f"resident page-cache read (memcpy from a mapped file) **{fmt(pc)} GB/s**. Failed runs: {nerr}. "
             f"Read-back checks: {vchk - verr}/{vchk} stamps correct.")
    L.append("")
    return L


def latency_lines(doc: dict[str, Any], lims: list[int], png: Callable[[str], str]) -> list[str]:
    """Fig. 10: prefill and decode latency of every configuration per limit (two tables)."""
    L = ["## Prefill and decode latency vs memory limit (Fig. 10)", "", f"![Fig. 10]({png('fig10')})", ""]
    head = ["limit (GiB)", "B_pc (GiB)"] + [LABELS[c] for c in CONFIGS]
    for field, name in (("prefill_s", "Prefill latency (s)"), ("decode_s", "Decode latency (s)")):
        rows = []
        for lim in lims:
            bpc = med([r for r in study_runs(doc, "sweep", "dualblade") if r["limit_bytes"] == lim],
                      "target.plan.budget_bytes")
            rows.append([gib(lim), fmt(bpc, 2, 1 / GiB, spread=False)]
                        + [_cell(doc, c, lim, field) for c in CONFIGS])
        L += [f"**{name}**", "", _table(head, rows), ""]
    return L


def hit_ratio_lines(doc: dict[str, Any], lims: list[int], png: Callable[[str], str]) -> list[str]:
    """Fig. 3 and Fig. 11: the decode hit ratio per limit against what fits, with Baseline's page cache."""
    L = ["## Page-cache hit ratio in decode (Fig. 3, Fig. 11)", "",
         f"![Fig. 3]({png('fig3')})", "", f"![Fig. 11]({png('fig11')})",
         "", "Hit ratio = page-cache-resident bytes / bytes read in decode (`cachestat(2)` on the exact range "
         "just before each copy; NVMe-direct reads count as misses). *Fits* = min(1, B_pc / KV set) with the "
         "B_pc the daemon computed (Eq. 1-2) at session open; *Group 1* = the share Algorithm 1 admitted then. The "
         "daemon re-samples B_pc while the session runs and may demote Group 1 KPUs to the NVMe-direct path "
         "(live re-planning); their reads then count as misses.", ""]
    rows = []
    for lim in lims:
        f, g1 = fits_fraction(doc, lim), group1_fraction(doc, lim)
        bl_pc = med([r for r in study_runs(doc, "sweep", "baseline") if r["limit_bytes"] == lim],
                    "cgroup.page_cache_decode_median")
        dbr = [r for r in study_runs(doc, "sweep", "dualblade") if r["limit_bytes"] == lim]
        rows.append([gib(lim), "-" if f is None else f"{f:.2f}", "-" if g1 is None else f"{g1:.2f}"]
                    + [_cell(doc, c, lim, "hit_ratio", 3) for c in CONFIGS]
                    + [fmt(med(dbr, "target_end.session.demoted_kpus"), 0, spread=False),
                       fmt(med(dbr, "hit_by_path.pagecache.hit_ratio"), 3),
                       fmt(bl_pc, 2, 1 / GiB, spread=False)])
    L += [_table(["limit (GiB)", "fits", "Group 1"] + [LABELS[c] for c in CONFIGS]
                 + ["Dual-Blade KPUs demoted live", "Dual-Blade page-cache-path hit",
                    "Baseline page cache in decode (GiB)"], rows), ""]
    return L


def decode_targets_lines(doc: dict[str, Any], lims: list[int]) -> list[str]:
    """Targets: Dual-Blade decode against T_ideal, the Baseline and the better single path; hit ratio."""
    ideal_rows = []
    db = by_key(study_runs(doc, "sweep", "dualblade"), lambda r: r["limit_bytes"])
    vs_base = paired_by_limit(doc, "sweep", "dualblade", "baseline")
    vs_best = paired_by_limit(doc, "sweep", "dualblade",
                     lambda c: min((c[k]["decode_s"] for k in ("cachepolicy", "direct") if k in c), default=None))
    for lim in lims:
        rs = db.get(lim, [])
        ir = summarize(ideal_ratio(doc, r) for r in rs)
        irp = summarize(ideal_ratio(doc, r, True) for r in rs)
        ti = summarize(t_ideal(doc, r) for r in rs)
        f = fits_fraction(doc, lim)
        hit = med(rs, "hit_ratio")
        hit_ok = None if f is None or hit["median"] is None else hit["median"] >= 0.9 * f
        vb = summarize(vs_base.get(lim, []))
        half = f is not None and (f >= 0.5)
        vbest = summarize(vs_best.get(lim, []))
        ideal_rows.append([
            gib(lim), fmt(med(rs, "decode_s")), fmt(ti), fmt(ir), _verdict(None if ir["median"] is None
                                                                           else ir["median"] <= 1.15), fmt(irp),
            fmt(vb) + ("" if half else " (n/a: < half fits)"),
            _verdict(None if not half or vb["median"] is None else vb["median"] <= 0.6),
            fmt(vbest), _verdict(None if vbest["median"] is None else vbest["median"] <= 1.0),
            fmt(hit, 3) + (f" vs 0.9x{f:.2f}" if f is not None else ""), _verdict(hit_ok)])
    return ["## Targets", "",
            "Per limit: Dual-Blade decode time against the two-tier ideal `T_ideal = Σ_steps (bytes_G1 / BW_pc + "
            "bytes_G2 / BW_dev)` with BW_pc and BW_dev (fio sequential read) of the same round; against the "
            "Baseline and against the better of CachePolicy-Only and NVMe-direct-Only (ratios of runs from the "
            "same round, median [min-max]); hit ratio against 0.9 x the fraction that fits. *ratio (pooled)* uses "
            "the medians of BW_pc and BW_dev over all rounds instead of the same round's single fio run.", "",
            _table(["limit (GiB)", "Dual-Blade decode (s)", "T_ideal (s)", "ratio", "≤ 1.15", "ratio (pooled)",
                    "÷ Baseline",
                    "≤ 0.6", "÷ best(CP, Direct)", "≤ 1.0", "hit ratio", "≥ 0.9 x fits"], ideal_rows), ""]


def direct_throughput_lines(doc: dict[str, Any]) -> list[str]:
    """Targets: NVMe-direct-Only read and write throughput against fio's in the same round."""
    fio_r = summarize(get(x, "fio.read_GBps") for x in doc["rounds"])
    fio_w = summarize(get(x, "fio.write_GBps") for x in doc["rounds"])
    dr = study_runs(doc, "sweep", "direct")

    def dev_ratio(r: dict[str, Any], field: str, op: str) -> float | None:
        dev = bw_dev(doc, r, op)
        val = get(r, field)
        return val / dev if dev and val is not None else None

    rd_ratio = summarize(dev_ratio(r, "throughput.decode_read_GBps", "read") for r in dr)
    wr_ratio = summarize(dev_ratio(r, "throughput.prefill_write_GBps", "write") for r in dr)
    return ["NVMe-direct-Only throughput against fio on the same filesystem in the same round (all limits; the "
            "direct path does not depend on the limit). Throughput = bytes / union of the time the requests of "
            "that kind were in flight (both channels).", "",
            _table(["", "NVMe-direct-Only (GB/s)", "fio (GB/s)", "ratio", "≥ 0.9"], [
                ["decode read", fmt(med(dr, "throughput.decode_read_GBps")), fmt(fio_r), fmt(rd_ratio),
                 _verdict(None if rd_ratio["median"] is None else rd_ratio["median"] >= 0.9)],
                ["prefill write", fmt(med(dr, "throughput.prefill_write_GBps")), fmt(fio_w), fmt(wr_ratio),
                 _verdict(None if wr_ratio["median"] is None else wr_ratio["median"] >= 0.9)]]), ""]


def append_latency_lines(doc: dict[str, Any]) -> list[str]:
    """Targets: the one-token append's latency per path against a bare io_uring write, alone and contended."""
    w = doc["workload"]
    bare = get(doc, "reference.bare_uring_write") or {}
    rows = []
    for cfg in CONFIGS:
        rs = study_runs(doc, "sweep", cfg)
        for path in sorted({k[len("decode_write["):-1] for r in rs for k in r.get("latency", {})
                            if k.startswith("decode_write[")}):
            s = med(rs, f"latency.decode_write[{path}].avg_ms")
            c = med(rs, f"latency.decode_write_client[{path}].avg_ms")
            if s["median"] is None:
                continue
            ratio = s["median"] / bare["avg_ms"] if bare.get("avg_ms") else None
            cratio = c["median"] / bare["avg_ms"] if bare.get("avg_ms") and c["median"] else None
            alone = med(rs, f"latency.decode_write_alone[{path}].avg_ms")
            cont = med(rs, f"latency.decode_write_contended[{path}].avg_ms")
            n_alone = sum(get(r, f"latency.decode_write_alone[{path}].n") or 0 for r in rs)
            n_cont = sum(get(r, f"latency.decode_write_contended[{path}].n") or 0 for r in rs)
            aratio = alone["median"] / bare["avg_ms"] if bare.get("avg_ms") and alone["median"] else None
            rows.append([LABELS[cfg], path, fmt(s, 3), fmt(med(rs, f"latency.decode_write[{path}].p99_ms"), 3),
                         "-" if ratio is None else f"{ratio:.2f}", fmt(c, 3),
                         "-" if cratio is None else f"{cratio:.2f}",
                         f"{fmt(alone, 3, spread=False)} ({n_alone})", "-" if aratio is None else f"{aratio:.2f}",
                         f"{fmt(cont, 3, spread=False)} ({n_cont})"])
    return [f"Decode write (one-token append, {w['token_bytes'] // 1024} KiB) per-tensor latency against a bare "
            f"in-process io_uring O_DIRECT write of the same size into fresh blocks of the same filesystem "
            f"(bladed's Engine, one at a time): avg {bare.get('avg_ms', float('nan')):.3f} ms, "
            f"p99 {bare.get('p99_ms', float('nan')):.3f} ms over {bare.get('n')} writes. *Server* = measured by "
            f"the daemon (or the TorchDisk child) around the copy/I/O; *client* = round trip seen by the copy "
            f"thread (adds the socket hop and queueing behind the same channel). *Alone* / *contended*: server "
            f"latency of the appends during which the other channel had no / had a request in flight that went "
            f"to the device (an NVMe-direct read or a page-cache read that missed), with the number of appends. "
            f"Medians over all limits.", "",
            _table(["config", "path", "server avg (ms)", "server p99 (ms)", "÷ bare", "client avg (ms)",
                    "÷ bare", "alone avg (ms) (n)", "÷ bare", "contended avg (ms) (n)"], rows), ""]


def table4_lines(doc: dict[str, Any], lowest: int | None) -> list[str]:
    """Table IV: per-tensor latency, device busy and server CPU per configuration at the lowest limit."""
    L = [f"## Per-tensor I/O latency and device busy at the lowest limit, {gib(lowest)} GiB (Table IV)", "",
         "Server-side latency per K or V request (avg / p99 in ms; medians of the per-run values). Decode reads "
         "exclude page-cache hits (hit < 5 %), as in the paper. Busy = block-layer io_ticks of the disk during "
         "each request / the request's duration, summed over the requests of that kind (the counters are "
         "device-wide: other I/O on the machine counts too).", ""]
    rows = []
    for cfg in CONFIGS:
        rs = [r for r in study_runs(doc, "sweep", cfg) if r["limit_bytes"] == lowest]
        if not rs:
            continue

        def lat(k: str, rs: list[dict[str, Any]] = rs) -> str:
            return f"{fmt(med(rs, f'latency.{k}.avg_ms'), 1, spread=False)} / " \
                   f"{fmt(med(rs, f'latency.{k}.p99_ms'), 1, spread=False)}"

        rows.append([LABELS[cfg], lat("prefill_write"), lat("decode_read_miss"),
                     f"{fmt(med(rs, 'latency.decode_write.avg_ms'), 3, spread=False)} / "
                     f"{fmt(med(rs, 'latency.decode_write.p99_ms'), 3, spread=False)}",
                     fmt(med(rs, "busy.prefill_write"), 0, 100, spread=False),
                     fmt(med(rs, "busy.decode_read_miss"), 0, 100, spread=False),
                     fmt(med(rs, "busy.decode_write"), 0, 100, spread=False),
                     fmt(med(rs, "cpu.s_per_GB"), 2, spread=False)])
    L += [_table(["config", "prefill W avg / p99", "decode R (misses) avg / p99", "decode W avg / p99",
                  "busy prefill W %", "busy decode R %", "busy decode W %", "server CPU s / GB"], rows), ""]
    return L


def fig12_lines(doc: dict[str, Any], lowest: int | None, png: Callable[[str], str]) -> list[str]:
    """Fig. 12: device throughput over time at the lowest limit, and the phase averages per configuration."""
    L = [f"## Device throughput over time at {gib(lowest)} GiB (Fig. 12)", "",
         f"![Fig. 12]({png('fig12')})", "",
         "Sampled every 100 ms from the disk's `/sys/block/*/stat` during the run with the median decode time "
         "of each configuration. Phase averages (all repetitions, bytes moved by the disk / phase time; "
         "busy = Δio_ticks / phase time):", ""]
    rows = []
    for cfg in CONFIGS:
        rs = [r for r in study_runs(doc, "sweep", cfg) if r["limit_bytes"] == lowest]
        if rs:
            rows.append([LABELS[cfg], fmt(med(rs, "disk_phase.prefill.write_GBps")),
                         fmt(med(rs, "disk_phase.prefill.busy"), 0, 100),
                         fmt(med(rs, "disk_phase.decode.read_GBps")), fmt(med(rs, "disk_phase.decode.busy"), 0, 100),
                         fmt(med(rs, lambda r: (get(r, "disk_phase.decode.read_bytes") or 0)
                                 / max(1, get(r, "bytes.decode_read") or 1)), 2)])
    L += [_table(["config", "prefill write GB/s", "prefill busy %", "decode read GB/s", "decode busy %",
                  "disk bytes read / bytes requested in decode"], rows), ""]
    return L


def cpu_lines(doc: dict[str, Any], lims: list[int]) -> list[str]:
    """Server CPU time per GB moved, per configuration and limit."""
    rows = []
    for lim in lims:
        rows.append([gib(lim)] + [_cell(doc, c, lim, "cpu.s_per_GB", 2) for c in CONFIGS])
    return ["## Server CPU time per GB moved", "",
            "utime + stime of the process serving the I/O (bladed daemon, or the Baseline's TorchDisk child), "
            "prefill + decode, divided by the bytes it moved. Kernel threads (writeback, kswapd, ext4 workers) "
            "are not included.", "", _table(["limit (GiB)"] + [LABELS[c] for c in CONFIGS], rows), ""]


def pipeline_lines(doc: dict[str, Any]) -> list[str]:
    """Pipeline parallelism on/off for every configuration (the ``pipeline`` study; nothing without it)."""
    pp = study_runs(doc, "pipeline")
    if not pp:
        return []
    main_pl = doc["plan"]["points"][0]["pipeline"]
    L = ["## Pipeline parallelism on/off, all configurations", "",
         f"Decode latency (s) with the main sweep's `{main_pl}` and without (`off`: read, DMA, read, DMA "
         f"one after another), at the same limits; ratio = on / off of runs in the same round.", ""]
    rows = []
    for lim in sorted({r["limit_bytes"] for r in pp}):
        for cfg in CONFIGS:
            on = [r for r in study_runs(doc, "sweep", cfg) if r["limit_bytes"] == lim]
            off = [r for r in pp if r["config"] == cfg and r["limit_bytes"] == lim]
            if not off:
                continue
            pairs = []
            offs = {r.get("round"): r for r in off}
            for r in on:
                o = offs.get(r.get("round"))
                if o:
                    pairs.append(r["decode_s"] / o["decode_s"])
            pls = sorted({r["pipeline"] for r in off})
            dec = [json.dumps(get(r, "pipeline_report.decision")) for r in on]
            rows.append([gib(lim), LABELS[cfg], fmt(med(off, "decode_s")) + f" ({'/'.join(pls)})",
                         fmt(med(on, "decode_s")), fmt(summarize(pairs)),
                         max(set(dec), key=dec.count) if dec else "-"])
    L += [_table(["limit (GiB)", "config", "decode w/o P·P", "decode w/ P·P", "ratio", "decision (most runs)"],
                 rows), ""]
    return L


#: the diagnostic studies of Dual-Blade alone: study -> (name, how it differs from the main sweep)
DIAGNOSTICS = {
    "headroom": ("budget headroom", "`budget.override` below the B_pc of Eq. 1-2 (the limit less 2 M_pin, "
                 "32 MiB for the daemon and a further fraction of the limit; see `plan.points`)"),
    "noreplan": ("live re-planning off", "`budget.live_replan = false`: the plan made at session open "
                 "is kept for the whole run"),
    "portable": ("the portable engine", "`io.engine = \"portable\"`: preadv2/pwritev2 on a thread pool instead "
                 "of io_uring (what runs where io_uring is refused)"),
}


def diagnostic_lines(doc: dict[str, Any], study: str) -> list[str]:
    """One diagnostic study (:data:`DIAGNOSTICS`) against the main sweep's Dual-Blade; nothing without it."""
    name, how = DIAGNOSTICS[study]
    hr = study_runs(doc, study)
    if not hr:
        return []
    L = [f"## Dual-Blade with {name} (diagnostic)", "",
         f"Dual-Blade as in the main sweep (*as-is*) and with {how}, at the same limits. *Demoted* = KPUs the "
         "daemon moved from Group 1 to the NVMe-direct path during the run (live re-planning); *page-cache "
         "hit* = hit ratio of the reads served on the page-cache path. Ratio = variant / as-is of runs in the "
         "same round.", ""]
    rows = []
    for lim in sorted({r["limit_bytes"] for r in hr}):
        h = [r for r in hr if r["limit_bytes"] == lim]
        base = [r for r in study_runs(doc, "sweep", "dualblade") if r["limit_bytes"] == lim]
        bases = {r.get("round"): r for r in base}
        pairs = [r["decode_s"] / bases[r.get("round")]["decode_s"] for r in h if r.get("round") in bases]
        for label, rs in (("as-is", base), (name, h)):
            rows.append([gib(lim), label, fmt(med(rs, "target.plan.budget_bytes"), 2, 1 / GiB, spread=False),
                         fmt(med(rs, "target.plan.group1_bytes"), 2, 1 / GiB, spread=False),
                         fmt(med(rs, "target_end.session.demoted_kpus"), 0),
                         fmt(med(rs, "hit_by_path.pagecache.hit_ratio"), 3), fmt(med(rs, "hit_ratio"), 3),
                         fmt(med(rs, "decode_s")), fmt(summarize(pairs)) if label == name else ""])
    L += [_table(["limit (GiB)", "Dual-Blade", "B_pc at open (GiB)", "Group 1 at open (GiB)", "demoted",
                  "page-cache hit", "hit ratio", "decode (s)", "ratio"], rows), ""]
    return L


def table5_lines(doc: dict[str, Any], png: Callable[[str], str]) -> list[str]:
    """Table V: the adaptive pipeline at alpha = B_pc / KV (the ``alpha`` study; nothing without it)."""
    al = study_runs(doc, "alpha")
    if not al:
        return []
    L = ["## Adaptive pipeline at alpha = B_pc / KV (Table V)", "",
         f"![Table V]({png('table5')})", "",
         "Dual-Blade with `budget.override = alpha x KV set` (so Group 1 holds alpha of the KV set) and a cgroup "
         "limit of that plus 2 M_pin plus 256 MiB. Decode latency (s); ratio = with / without P·P of runs "
         "in the same round; the decision is the adaptive pipeline's choice per group after its trial "
         "iterations (2: overlap-intra, 3: overlap-cross), with the measured throughputs (GB/s) of the "
         "trials.", ""]
    rows = []
    for a in sorted({r["alpha"] for r in al}):
        ra = [r for r in al if r["alpha"] == a]
        off = [r for r in ra if r["pipeline"] == "off"]
        on = [r for r in ra if r["pipeline"] != "off"]
        offs = {r.get("round"): r for r in off}
        pairs = [r["decode_s"] / offs[r.get("round")]["decode_s"] for r in on if r.get("round") in offs]
        dec = [json.dumps(get(r, "pipeline_report.decision"), sort_keys=True) for r in on]
        intra = [get(r, "pipeline_report.intra_GBps") for r in on]
        cross = [get(r, "pipeline_report.cross_GBps") for r in on]
        groups = sorted({g for d in intra + cross if d for g in d})
        trial = "; ".join(
            f"G{g}: intra {fmt(summarize((d or {}).get(g) for d in intra), 2, spread=False)}, "
            f"cross {fmt(summarize((d or {}).get(g) for d in cross), 2, spread=False)}" for g in groups)
        rows.append([f"{a}", fmt(med(ra, "target.plan.group1_bytes"), 2, 1 / GiB, spread=False),
                     fmt(med(off, "decode_s")), fmt(med(on, "decode_s")), fmt(summarize(pairs)),
                     max(set(dec), key=dec.count) if dec else "-", trial])
    L += [_table(["alpha", "Group 1 (GiB)", "w/o P·P", "w/ P·P", "ratio", "decision (most runs)",
                  "trial throughput (median)"], rows), ""]
    return L


def format_lines(doc: dict[str, Any], lims: list[int]) -> list[str]:
    """Issue 31's ratios: each per limit, median over the rounds of the ratio within a round (same limit, same
    repetition): decode q8 / plain Dual-Blade, decode Dual-Blade q8 / Baseline q8, prefill q8 / plain."""
    runs = [r for r in doc["runs"] if "error" not in r and r["study"] == "sweep"]
    fmts = sorted({r["kv_format"] for r in runs if r.get("kv_format")})
    if not fmts:
        return []
    rounds = by_key(runs, lambda r: (r.get("round"), r["limit_bytes"]))
    charged = doc["plan"].get("codec_charge", True)
    L = ["## KV formats (issue 31)", "",
         ("Codec rates charged" if charged else "No codec time charged (the storage side alone); rates measured")
         + " (this CPU, GB/s of decoded input): " + ", ".join(
             f"{f} quantize {c['quantize_gbps']:.2f} / dequantize {c['dequantize_gbps']:.2f}"
             for f, c in sorted(doc.get("codec", {}).items()) if c.get("quantize_gbps")), ""]
    head = ["limit (GiB)"]
    cols: list[tuple[str, str, str]] = []
    for f in fmts:
        cols += [(f"dualblade-{f}", "dualblade", "decode_s"), (f"dualblade-{f}", f"baseline-{f}", "decode_s"),
                 (f"dualblade-{f}", "dualblade", "prefill_s")]
    head += [f"{'prefill' if fld == 'prefill_s' else 'decode'} {a} / {b}" for a, b, fld in cols]
    head += [f"decode dualblade-{f} / T_ideal of its bytes" for f in fmts]
    rows = []
    for lim in lims:
        row = [gib(lim)]
        for a, b, fld in cols:
            ratios = []
            for (_rnd, rl), rs in rounds.items():
                by = {run_name(r): r for r in rs}
                if rl == lim and a in by and b in by and get(by[a], fld) and get(by[b], fld):
                    ratios.append(get(by[a], fld) / get(by[b], fld))
            row.append(fmt(summarize(ratios), 3))
        for f in fmts:   # against the two-tier ideal of the bytes it stored (target <= 1.15)
            row.append(fmt(summarize(ideal_ratio(doc, r) for r in runs
                                     if run_name(r) == f"dualblade-{f}" and r["limit_bytes"] == lim), 3))
        rows.append(row)
    return [*L, _table(head, rows), ""]


def closing_lines(analysis: str | None) -> list[str]:
    """The analysis (hand-written, kept across regenerations) and how to reproduce the sweep."""
    return ["## Analysis", "", analysis or "<!-- analysis:begin -->\n(to be written)\n<!-- analysis:end -->", "",
            "## Reproduce", "", "```", "sudo python3 tools/bench_kv.py sweep --json docs/bench/kv-sweep-DATE.json",
            "python3 tools/bench_kv.py report docs/bench/kv-sweep-DATE.json --out docs/bench/kv-report.md", "```",
            "", "All options: `python3 tools/bench_kv.py sweep --help`. The plan of this sweep (every point, "
            "repetitions, probe sizes) is in the JSON under `plan`.", ""]


def render(doc: dict[str, Any], *, png_prefix: str = "kv", png_dir_rel: str = ".", analysis: str | None = None,
           title: str = "KV-cache offloading: reproducing the Dual-Blade evaluation") -> str:
    """The Markdown report: the sections below, one function per table or figure."""

    def png(name: str) -> str:
        return f"{png_dir_rel}/{png_prefix}-{name}.png"

    lims = sweep_limits(doc)
    lowest = lims[0] if lims else None
    sections = [
        header_lines(doc, title),
        latency_lines(doc, lims, png),
        hit_ratio_lines(doc, lims, png),
        decode_targets_lines(doc, lims),
        direct_throughput_lines(doc),
        append_latency_lines(doc),
        table4_lines(doc, lowest),
        fig12_lines(doc, lowest, png),
        cpu_lines(doc, lims),
        pipeline_lines(doc),
        *(diagnostic_lines(doc, study) for study in DIAGNOSTICS),
        table5_lines(doc, png),
        format_lines(doc, lims),
        closing_lines(analysis),
    ]
    return "\n".join(line for section in sections for line in section)


def write_report(doc: dict[str, Any], md_path: str, *, png_prefix: str = "kv") -> list[str]:
    """Write the Markdown report and its PNGs next to it; returns the files written."""
    out_dir = os.path.dirname(os.path.abspath(md_path))
    os.makedirs(out_dir, exist_ok=True)
    analysis = None
    if os.path.exists(md_path):
        with open(md_path) as f:
            m = ANALYSIS_RE.search(f.read())
            analysis = m.group(0) if m else None
    lims = sweep_limits(doc)
    files = []
    plots: list[tuple[str, Callable[[dict[str, Any], str], None]]] = [
        ("fig3", plot_fig3), ("fig10", plot_fig10), ("fig11", plot_fig11),
        ("fig12", lambda d, p: plot_fig12(d, p, lims[0] if lims else None)),
    ]
    if study_runs(doc, "alpha"):
        plots.append(("table5", plot_table5))
    for name, fn in plots:
        p = os.path.join(out_dir, f"{png_prefix}-{name}.png")
        fn(doc, p)
        files.append(p)
    text = render(doc, png_prefix=png_prefix, analysis=analysis)
    with open(md_path, "w") as f:
        f.write(text)
    files.append(md_path)
    return files


__all__ = ["ideal_ratio", "load", "render", "study_runs", "t_ideal", "write_report"]
