"""tools/install.sh, as documented in docs/operations.md ("Install"), from a fresh Debian 12 root:
tools/vm/install/test-install.sh bootstraps (or copies a cached) `debootstrap --variant=minbase` root, installs there
with chroot and checks the result, a second run, an upgrade, --enable and the uninstall (its header lists
every check).

Needs root, debootstrap (tools/setup.sh installs it) and the network to deb.debian.org and pypi.org; without
them it fails, naming what is missing. On the 2-core CI machine it takes 1-1.5 minutes with a warm cache (the
cached root is rebuilt weekly) and 2.5-3.5 minutes cold, depending on the load (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest
from daemon_util import ROOT

SCRIPT = os.path.join(ROOT, "tools", "vm", "install", "test-install.sh")
TIMEOUT_S = 560  # below pytest-timeout's 600 s, so that a hang fails here with the script's output


@pytest.mark.root
@pytest.mark.slow
def test_install_sh_in_a_fresh_debian12_root() -> None:
    proc = subprocess.Popen([SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM: the script's EXIT trap removes its root copy; the mounts die with its namespace
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)     # what the trap did not end in time
            proc.wait()
        pytest.fail(f"tools/vm/install/test-install.sh took over {TIMEOUT_S} s; its output:\n{out[-6000:]}")
    lines = out.splitlines()
    errors = [ln for ln in lines if "error:" in ln or "FAIL" in ln]
    assert proc.returncode == 0, (
        f"tools/vm/install/test-install.sh exited {proc.returncode}: {errors[-1] if errors else ''}\n"
        + "\n".join(lines[-60:]))
    assert lines[-1].startswith("test-install: PASS"), lines[-1]
