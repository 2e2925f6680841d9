"""The GPU check's report: ``gpu-check.json`` and the lines that sum it up.

The JSON is written again after every step (:func:`save`); at the end come the headline figures pulled out of
the steps' data (:func:`figures`), the verdict (:func:`verdict`) and the summary of the log
(:func:`summary_lines`). :func:`parse_junit` reads back the ``cuda`` tests' JUnit XML. Standard library only.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence

from gpu_run import CUDA_STEPS, Result, short

SCHEMA = "bladed.gpu_check/1"
JSON_NAME = "gpu-check.json"
LOG_NAME = "gpu-check.log"


def parse_junit(path: str) -> list[Result]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "")[:2000]
                break
        out.append({"name": tc.get("name"), "class": tc.get("classname"), "outcome": outcome,
                    "seconds": float(tc.get("time") or 0.0), **({"message": message} if message else {})})
    return out


def counts(tests: list[Result]) -> dict[str, int]:
    keys = ("passed", "failed", "error", "skipped")
    return {k: sum(1 for t in tests if t["outcome"] == k) for k in keys}


def save(doc: Result, out_dir: str) -> None:
    path = os.path.join(out_dir, JSON_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def figures(doc: Result) -> Result:
    """The headline numbers, pulled out of the steps' data (None where a step did not produce them)."""
    st = doc["steps"]
    bw = (st.get("bandwidth") or {}).get("data") or {}
    rn = (st.get("runner") or {}).get("data") or {}
    sw = (st.get("sweep") or {}).get("data") or {}
    env = (st.get("environment") or {}).get("data") or {}
    pr = (st.get("profile") or {}).get("data") or {}
    e2e = (st.get("e2e") or {}).get("data") or {}
    fg = (st.get("flexgen") or {}).get("data") or {}
    return {
        "gpu": env.get("gpu_name"), "driver": env.get("driver"), "cuda": env.get("torch_cuda"),
        "driver_cuda": (env.get("nvidia_smi") or {}).get("driver_cuda"), "nvcc": env.get("nvcc"),
        "torch": env.get("torch"), "transformers": env.get("transformers"), "kernel": env.get("kernel"),
        "io_uring": (env.get("io_uring") or {}).get("available"),
        "staging_bandwidth": bw.get("summary"), "runner_tokens_per_s": rn.get("summary"),
        "sparse_reads": ((st.get("sparse") or {}).get("data") or {}).get("summary"),
        "kv_sweep_point": sw.get("summary"),
        "cgroup_parent": ((st.get("cgroups") or {}).get("data") or {}).get("parent"),
        "flexgen": {"wheels": fg.get("wheels"), "tokenizer": (fg.get("tokenizer") or {}).get("class"),
                    "patches": sorted(fg.get("patches") or {})} if fg else None,
        "runner_profile": pr.get("summary"),
        "e2e": e2e_figures(e2e) if e2e else None,
    }


def e2e_figures(e2e: Result) -> Result:
    """The e2e step's headline: decode tokens/s per limit and side (medians), FlexGen's, and the issue's ratios."""
    out: Result = {"kv_bytes": e2e.get("kv_bytes"), "budget": e2e.get("budget"), "by_fraction": {}}
    fg = (e2e.get("flexgen") or {}).get("by_fraction") or {}
    for row in (e2e.get("summary") or {}).get("by_limit", []):
        cell: Result = {side: (v.get("decode_tok_s") or {}).get("median") for side, v in row["sides"].items()}
        f = fg.get(f"{row['fraction']:g}") or {}
        cell["flexgen"] = (f.get("decode_tok_s") or {}).get("median")
        for key, m in (("dualblade/mmap decode time", (row["ratios"].get("dualblade/mmap") or {}).get("decode_time")),
                       ("dualblade/flexgen decode time", f.get("dualblade/flexgen_decode_time")),
                       ("dualblade/flexgen ttft", f.get("dualblade/flexgen_ttft_time"))):
            cell[key] = (m or {}).get("median")
        out["by_fraction"][f"{row['fraction']:g}"] = cell
    return out


def verdict(doc: Result, steps: Sequence[str]) -> bool:
    """Every step passed or was skipped (``--skip``); in a rehearsal the CUDA parts may be ``not_run`` for want of
    CUDA (or torch); and every one of ``steps`` (the run's) has a result."""
    for name, res in doc["steps"].items():
        status = res.get("status")
        reason = str(res.get("reason", ""))
        if status == "passed" or (status == "not_run" and reason.startswith("skipped (--skip")):
            continue
        if status == "not_run" and doc["mode"] == "rehearse" and (
                (name in CUDA_STEPS and reason.startswith(("no CUDA", "no torch")))
                or (name == "cgroups" and reason.startswith("not root"))):
            continue
        return False
    return len(doc["steps"]) == len(steps)


def summary_lines(doc: Result) -> Iterator[str]:
    f = doc["figures"]
    yield (f"summary: {doc['mode']} ok={doc['ok']} in {doc['wall_s']} s; gpu {f['gpu']}, driver {f['driver']}, "
           f"CUDA {f['cuda']}, torch {f['torch']}, transformers {f['transformers']}, kernel {f['kernel']}, "
           f"io_uring {f['io_uring']}")
    for name, res in doc["steps"].items():
        yield f"  {name:12s} {res['status']:8s} {res.get('seconds', 0):6.1f} s" + (
            f"  {short(res['reason'])}" if res.get("reason") else "")
    for key in ("staging_bandwidth", "runner_tokens_per_s", "sparse_reads", "kv_sweep_point", "runner_profile", "e2e"):
        if f.get(key):
            yield f"  {key}: {json.dumps(f[key], default=str)}"
