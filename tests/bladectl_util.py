"""Run ``bladectl`` as a user does: the real entry point, in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from daemon_util import env_with_repo


def bladectl(*args: str, cwd: str, env: dict[str, str] | None = None,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``bladectl ARGS`` run from ``cwd``, without BLADED_SOCKET unless ``env`` sets it."""
    e = env_with_repo()
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "bladed.cli.bladectl", *args], cwd=cwd, env=e, input=input,
                          capture_output=True, text=True, timeout=120)


def one_object(r: subprocess.CompletedProcess[str]) -> Any:
    """stdout, which must be exactly one JSON value."""
    return json.loads(r.stdout)


def failure(r: subprocess.CompletedProcess[str], status: int, code: str) -> str:
    """The message of a ``--json`` failure, after checking its shape, code and exit status."""
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    got = one_object(r)
    assert got["ok"] is False and got["error"]["code"] == code, got
    assert "Traceback" not in r.stderr, r.stderr
    return str(got["error"]["message"])


def one_line(r: subprocess.CompletedProcess[str], status: int) -> str:
    """The one ``bladectl: ...`` line of a failure without ``--json``."""
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bladectl: "), r.stderr
    return lines[0].removeprefix("bladectl: ")
