"""Where the harness and the source checkout are, and the environment of the processes it starts.

A leaf: the driver (:mod:`bladed_bench.workload`) and the Baseline (:mod:`bladed.torchdisk`) both
start children that must import the same ``bladed`` and ``bladed_bench`` as the harness itself.
"""

from __future__ import annotations

import os

#: the directory holding the ``bladed_bench`` package (``bench/`` in a source checkout)
HARNESS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the source checkout: holds ``bladed/`` and ``docs/bench/`` (the default place of sweep JSONs and reports)
REPO = os.path.dirname(HARNESS_ROOT)


def repo_env() -> dict[str, str]:
    """This environment for a child (a daemon, the TorchDisk child): the checkout's ``bladed`` and this
    harness first on ``PYTHONPATH``, no inherited systemd notify socket or bladed socket."""
    env = dict(os.environ)
    paths = [REPO, HARNESS_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for k in ("NOTIFY_SOCKET", "BLADED_SOCKET"):
        env.pop(k, None)
    return env


__all__ = ["HARNESS_ROOT", "REPO", "repo_env"]
