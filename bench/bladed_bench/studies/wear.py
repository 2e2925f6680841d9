"""What a chat workload's KV cache makes the drive write: bladed (Group 1 in memory files), bladed with Group 1
on disk (before issue 39) and FlexLLMGen's mmap offload, in one run (docs/benchmarks.md, "Wear").

::

    sudo tools/bench_wear.py                        # 4 sessions of about 5 minutes per side, 3 sides: ~20 min
    sudo tools/bench_wear.py --sessions 2 --turns 2 --gap 5   # a quick look

Each side keeps its files on an ext4 filesystem on a loop device of its own, so the device's written sectors are
exactly that side's; the KV's owner (the daemon, the mmap owners) runs in a memory cgroup that holds only
``--in-memory`` sessions' KV. The harness is ``bench/bladed_bench/wear.py`` (its docstring says what is measured).
Needs root (loop devices, mounts, cgroups).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bladed_bench.repo import REPO as ROOT
from bladed_bench.wear import SIDES, ChatSpec, markdown, run_wear


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    d = ChatSpec()
    p = argparse.ArgumentParser(prog=prog or "tools/bench_wear.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--sessions", type=int, default=d.sessions, help=f"conversations (default {d.sessions})")
    p.add_argument("--turns", type=int, default=d.turns, help=f"turns per conversation (default {d.turns})")
    p.add_argument("--gap", type=float, default=d.gap_s, help=f"seconds between turns (default {d.gap_s:g})")
    p.add_argument("--stagger", type=float, default=d.stagger_s,
                   help=f"seconds between the sessions' starts (default {d.stagger_s:g})")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    p.add_argument("--in-memory", type=float, default=d.sessions_in_memory,
                   help="how many sessions' KV the owner's memory cgroup holds (default "
                        f"{d.sessions_in_memory:g}: the later sessions are above the budget)")
    p.add_argument("--workdir", default="/var/tmp/bladed-wear", help="where the loop devices' files go")
    p.add_argument("--json", default=None, help="default: docs/bench/wear-<UTC time>.json")
    p.add_argument("--parallel", action="store_true",
                   help="run the sides at once (each has its own loop device; the time of one side)")
    a = p.parse_args(argv)
    sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        p.error(f"--sides {a.sides}: choose from {', '.join(SIDES)}")
    if os.geteuid() != 0:
        p.error("needs root: loop devices, mounts and memory cgroups")
    spec = ChatSpec(sessions=a.sessions, turns=a.turns, gap_s=a.gap, stagger_s=a.stagger,
                    prompt_tokens=a.prompt_tokens, reply_tokens=a.reply_tokens, sessions_in_memory=a.in_memory)
    out = a.json or os.path.join(ROOT, "docs", "bench", time.strftime("wear-%Y-%m-%dT%H%MZ.json", time.gmtime()))
    doc = run_wear(spec, sides, a.workdir, out, say=lambda m: print(m, file=sys.stderr, flush=True),
                   parallel=a.parallel)
    print(markdown(doc))
    print(out)
    return 0 if all("error" not in r and not r.get("errors") for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
