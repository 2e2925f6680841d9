"""bladed under a real systemd: the shipped unit (systemd/bladed.service) and
udev rule (udev/60-bladed.rules) in the VM booted with ``run-in-nvme-vm.sh
--init systemd`` (systemd 252 of the host as PID 1, Linux 6.12, cgroup v2
only), on the emulated NVMe namespace.

What is installed is what docs/operations.md tells an operator to install
(where tools/install.sh puts it): the user and group ``bladed`` from
systemd/bladed.sysusers, the udev rule
with the controller's serial filled in, the unit, and its shipped drop-in
``systemd/dropins/nvme-device.conf``.  One more drop-in, ``test-paths.conf``,
changes only where the daemon's program is: /opt/bladed is not installed in
the VM, so ``ExecStartPre=``/``ExecStart=`` run this checkout's interpreter
(``python -m bladed.server`` with the unit's own arguments) on this checkout's
code (``Environment=PYTHONPATH=``), and where that
interpreter lives under /root or /home (pyenv), ``ProtectHome=tmpfs`` with a
read-only bind of it replaces ``ProtectHome=yes``; a checkout under /tmp or
/var/tmp is bound read-only into the unit's private /tmp.  The state directory is on
ext4 on namespace 2, so page-cache files are file pages.

Kept to two daemon starts: under TCG every Python start-up costs seconds, and
each start is two (``ExecStartPre=... --check-config``).
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nvmevm import NG_PATH, ng_path
from systemdvm import TIMEOUT, UNPRIVILEGED_PASSTHROUGH, JournalWatch, disk, run, show, start, systemd_problem

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import ClientProcess, forked_as, pattern, toml_text

from bladed.client import Client
from bladed.io import Engine, StagingBuffer
from bladed.io.nvme import NvmeDevice
from bladed.protocol import PermissionDeniedError
from bladed.residency.budget import REACTION_S

pytestmark = pytest.mark.systemd_vm

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "bladed.service"
DROPINS = REPO / "systemd" / "dropins"
RULE = REPO / "udev" / "60-bladed.rules"
INSTALLED_UNIT = Path("/usr/local/lib/systemd/system/bladed.service")     # where tools/install.sh puts it
ETC_DROPINS = Path("/etc/systemd/system/bladed.service.d")
CONFIG = Path("/etc/bladed/bladed.toml")
SOCKET = "/run/bladed/bladed.sock"
INSTALLED_BINARY = "/opt/bladed/bin/bladed"
CGROUP = "/sys/fs/cgroup/system.slice/bladed.service"
MAX_EXPOSURE = 2.5
MiB = 1 << 20
# token = 2*8*128*2 = 4096 bytes: aligned on 512- and 4096-byte LBAs; KPU = 16 tokens = 64 KiB
GEOMETRY = {"layers": 3, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 16}
KPU = 16 * 4096
#: the shipped drop-ins this kernel needs (docs/operations.md): the namespace, and CAP_SYS_ADMIN before 6.2
DROPINS_USED = ["nvme-device.conf"] + ([] if UNPRIVILEGED_PASSTHROUGH else ["cap-sys-admin.conf"])
CAP_SYS_ADMIN = 1 << 21


def paths_dropin() -> str:
    """The drop-in that points the shipped unit at this checkout (see the module docstring)."""
    unit = UNIT.read_text()
    lines = ["# tests/vm/test_systemd_in_vm.py: this checkout's interpreter and code instead of /opt/bladed",
             "[Service]", f"Environment=PYTHONPATH={REPO}"]
    for key in ("ExecStartPre", "ExecStart"):
        (value,) = re.findall(rf"^{key}=(.*)$", unit, re.M)
        assert value.startswith(INSTALLED_BINARY + " "), value
        lines += [f"{key}=", f"{key}={sys.executable} -m bladed.server{value[len(INSTALLED_BINARY):]}"]
    base = os.path.realpath(sys.base_prefix)
    if base.startswith(("/root/", "/home/")):
        lines += ["ProtectHome=tmpfs", f"BindReadOnlyPaths={base}"]
    # a checkout (and its venv) under /tmp is hidden by the unit's PrivateTmp=yes: bind it into the private /tmp
    repo, venv = os.path.realpath(REPO), os.path.realpath(sys.prefix)
    for path in [repo] + ([] if venv.startswith(repo + "/") else [venv]):
        if path.startswith(("/tmp/", "/var/tmp/")):
            lines.append(f"BindReadOnlyPaths={path}")
    return "\n".join(lines) + "\n"


def config(lba: int, *, measured: bool = False, **extra: dict[str, Any]) -> str:
    """The daemon's configuration; ``measured``: B_pc from Eq. 1-2, not a fixed ``budget.override``."""
    sections: dict[str, dict[str, Any]] = {
        "daemon": {"state_dir": "/var/lib/bladed"},
        "device": {"backend": "nvme", "path": "/dev/bladed/kv", "lba_size": lba, "region_blocks": 64 * MiB // lba},
        "socket": {"path": SOCKET, "mode": "0660", "group": "bladed"},
        "access": {"allowed_gids": [grp.getgrnam("bladed").gr_gid]},
        "budget": {} if measured else {"override": 2 * KPU},
    }
    for section, keys in extra.items():
        sections.setdefault(section, {}).update(keys)
    return toml_text(sections)


@pytest.fixture(scope="module")
def installed(vm_config: Any) -> Iterator[dict[str, Any]]:
    """bladed installed as docs/operations.md says, with the test's paths drop-in; stopped at the end."""
    problem = systemd_problem()
    assert problem is None, problem
    # the user and group, as tools/install.sh makes them
    run("systemd-sysusers", str(REPO / "systemd" / "bladed.sysusers"))
    # the state directory on a disk filesystem (namespace 2)
    state = os.path.join(disk(), "bladed-state")
    os.makedirs(state, exist_ok=True)
    os.makedirs("/var/lib/bladed", exist_ok=True)
    run("mount", "--bind", state, "/var/lib/bladed")
    # the udev rule, with this controller's serial
    serial = Path("/sys/class/nvme/nvme0/serial").read_text().strip()
    rule = RULE.read_text()
    assert rule.count('ATTRS{serial}=="SERIAL"') == 1
    Path("/etc/udev/rules.d/60-bladed.rules").write_text(rule.replace('=="SERIAL"', f'=="{serial}"'))
    run("udevadm", "control", "--reload")
    run("udevadm", "trigger", "--settle", "--subsystem-match=nvme-generic", "--action=add")
    # the unit, its NVMe drop-in, the test's paths, the configuration
    INSTALLED_UNIT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(UNIT, INSTALLED_UNIT)
    ETC_DROPINS.mkdir(parents=True, exist_ok=True)
    for name in DROPINS_USED:
        shutil.copyfile(DROPINS / name, ETC_DROPINS / name)
    (ETC_DROPINS / "test-paths.conf").write_text(paths_dropin())
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    CONFIG.write_text(config(vm_config.lba_size))
    run("systemctl", "daemon-reload")
    try:
        yield {"lba": vm_config.lba_size, "gid": grp.getgrnam("bladed").gr_gid}
    finally:
        run("systemctl", "stop", "bladed.service", check=False)


def test_udev_gives_nsid_1_to_group_bladed(installed: dict[str, Any], vm_config: Any) -> None:
    gid = installed["gid"]
    ours = ng_path(1)
    st = os.stat(ours)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, gid, 0o660), f"{ours}: {st}"
    assert os.path.realpath("/dev/bladed/kv") == ours
    for nsid in range(2, vm_config.namespaces + 1):
        other = os.stat(ng_path(nsid))
        assert (other.st_gid, stat.S_IMODE(other.st_mode)) == (0, 0o600), f"NSID {nsid} was given away"
    assert show("dev-bladed-kv.device", "ActiveState")["ActiveState"] == "active"
    # udevadm test: what the rules decide for each namespace's generic device (its log is on stderr)
    for nsid in (1, 2):
        name = os.path.basename(ng_path(nsid))
        r = run("udevadm", "test", "--action=add", f"/sys/class/nvme-generic/{name}")
        out = r.stdout + r.stderr
        m = re.search(rf"permissions (?:of )?/dev/{name}, uid=(\d+), gid=(\d+), mode=(\d+)", out)
        assert m, out[-3000:]
        ours_rule = re.findall(rf"^{name}: /etc/udev/rules.d/60-bladed.rules:\d+ (GROUP|MODE|LINK) (.*)$", out, re.M)
        if nsid == 1:
            assert (int(m.group(1)), int(m.group(2)), m.group(3)) == (0, gid, "0660"), m.group(0)
            assert ours_rule == [("GROUP", str(gid)), ("MODE", "0660"), ("LINK", "'bladed/kv'")], out[-3000:]
        else:
            assert (int(m.group(1)), int(m.group(2)), m.group(3)) == (0, 0, "0600"), m.group(0)
            assert ours_rule == [], out[-3000:]


def test_the_installed_unit(installed: dict[str, Any]) -> None:
    p = show("bladed.service", "FragmentPath", "DropInPaths", "User", "Group", "BindsTo", "After", "DeviceAllow")
    assert Path(p["FragmentPath"]).read_bytes() == UNIT.read_bytes()
    assert sorted(os.path.basename(d) for d in p["DropInPaths"].split()) == sorted([*DROPINS_USED,
                                                                                  "test-paths.conf"])
    assert (p["User"], p["Group"]) == ("bladed", "bladed")
    assert "dev-bladed-kv.device" in p["BindsTo"].split() and "dev-bladed-kv.device" in p["After"].split()
    assert "systemd-udev-settle.service" not in p["After"]
    assert p["DeviceAllow"].startswith("/dev/bladed/kv rw")
    out = run("systemd-analyze", "security", "--no-pager", "bladed.service").stdout
    m = re.search(r"Overall exposure level for bladed\.service: (\d+\.\d)", out)
    assert m, out[-2000:]
    print(f"systemd-analyze security bladed.service (installed, with {', '.join(DROPINS_USED)}): {m.group(1)}")
    assert float(m.group(1)) <= MAX_EXPOSURE, out


def proc_status(pid: int) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text()
                                         .splitlines())}


def connect_as(uid: int, groups: list[int]) -> dict[str, Any]:
    """``status`` from a forked child with ``uid`` (gid the same) and ``groups`` as supplementary groups."""

    def body(out: dict[str, Any]) -> None:
        try:
            with Client(SOCKET) as c:
                out["pid"] = c.status()["pid"]
        except Exception as e:
            out["error"] = type(e).__name__

    return forked_as(uid, body, groups)


def read_extent(ext: dict[str, int], lba: int) -> bytes:
    dev = NvmeDevice(NG_PATH)
    try:
        nbytes = ext["nblocks"] * lba
        with StagingBuffer(nbytes) as buf, Engine(dev, 8) as eng:
            buf.view()[:] = b"\xff" * nbytes
            eng.read(ext["start"], buf, nbytes=nbytes)
            return buf.view().tobytes()
    finally:
        dev.close()


@pytest.fixture
def stopped(installed: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """bladed is stopped before and after the test (whatever the test left running)."""
    run("systemctl", "stop", "bladed.service")
    run("systemctl", "reset-failed", "bladed.service", check=False)
    yield installed
    run("systemctl", "stop", "bladed.service")


def test_start_io_memory_knob_reload_and_stop(stopped: dict[str, Any]) -> None:
    lba, gid = stopped["lba"], stopped["gid"]
    with JournalWatch("bladed.service") as journal:
        # -- start: Type=notify, so systemctl returns at READY=1 -----------------------------------
        start("bladed.service")
        p = show("bladed.service", "ActiveState", "SubState", "MainPID", "StatusText")
        assert (p["ActiveState"], p["SubState"]) == ("active", "running"), p
        assert p["StatusText"].startswith(f"serving on {SOCKET}: nvme /dev/bladed/kv"), p
        pid = int(p["MainPID"])
        journal.wait(r"event=daemon_start .*backend=nvme device=/dev/bladed/kv", after=0)   # the watch's start
        bladed_uid = os.stat("/var/lib/bladed").st_uid
        ps = proc_status(pid)
        assert ps["Uid"].split() == [str(bladed_uid)] * 4 and ps["Gid"].split() == [str(gid)] * 4, ps
        caps = 0 if UNPRIVILEGED_PASSTHROUGH else CAP_SYS_ADMIN      # cap-sys-admin.conf before 6.2
        assert {k: int(ps[k], 16) for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")} == dict.fromkeys(
            ("CapPrm", "CapEff", "CapBnd", "CapAmb"), caps), ps
        assert (ps["NoNewPrivs"], ps["Seccomp"]) == ("1", "2")
        sock = os.stat(SOCKET)
        assert (sock.st_uid, sock.st_gid, stat.S_IMODE(sock.st_mode)) == (bladed_uid, gid, 0o660)

        with Client(SOCKET) as admin:
            st = admin.status()
            assert st["device"]["kind"] == "nvme" and st["budget"]["cgroup"] == CGROUP
            assert st["budget"]["cgroup_version"] == "v2"
            # the unit's memory.pressure is root's: the daemon's PSI trigger is on the host's pressure; with no
            # limit on the way up, nothing of the unit's cgroup is watched
            assert admin.stats()["replan"]["sources"] == ["psi:/proc/pressure/memory"]

            # -- I/O through the hardened unit: io_uring passthrough on the namespace ------------------
            with ClientProcess(SOCKET, timeout=TIMEOUT) as c:
                assert c.call("connect", timeout=TIMEOUT)["server"]["lba_size"] == lba
                ext = c.call("open", geometry=GEOMETRY, timeout=TIMEOUT)["extent"]
                paths = c.call("write_all", seed=7, timeout=TIMEOUT)["paths"]
                assert paths == ["pagecache"] * 2 + ["direct"] * 4
                assert c.call("check_all", seed=7, timeout=TIMEOUT)["bad"] == []
                io = admin.stats()["io"]
                assert io["direct"]["write"]["bytes"] == 4 * KPU and io["direct"]["read"]["bytes"] == 4 * KPU
                assert read_extent(ext, lba) != bytes(ext["nblocks"] * lba)

                # -- access: a client's supplementary group counts (its /proc/<pid>/status) ----------
                assert connect_as(4242, [gid]) == {"pid": pid}
                assert connect_as(4243, []) == {"error": PermissionDeniedError.__name__}

                # -- MemoryHigh= / MemoryMax=: the page-cache knob -----------------------------------
                run("systemctl", "set-property", "--runtime", "bladed.service", "MemoryHigh=300M", "MemoryMax=400M")
                assert Path(CGROUP, "memory.high").read_text().strip() == str(300 * MiB)
                s = admin.budget()["sample"]
                assert (s["memory_limit_bytes"], s["memory_limit_source"]) == (300 * MiB, f"{CGROUP}/memory.high"), s
                # Eq. 1 with the page cache the unit maps kept, the kernel's other charges, and M_free left free:
                # budget.headroom (0.02) of the limit, at least budget.absorb_rate's floor (1 GiB/s x 25 ms)
                assert s["free_bytes"] == max(int(0.02 * 300 * MiB), int((1 << 30) * REACTION_S))
                assert s["mapped_bytes"] >= 0 and s["charged_kernel_bytes"] >= 0
                assert s["usable_bytes"] == min(s["host_available_bytes"], 300 * MiB - s["anon_shmem_bytes"]
                                                - s["charged_kernel_bytes"] - s["mapped_bytes"] - s["free_bytes"])
                # budget.override fixes B_pc: the memory watch arms nothing for the unit's new limit
                assert admin.stats()["replan"]["sources"] == ["psi:/proc/pressure/memory"]
                # the session's Group 1 (2 KPUs in memory files: pagecache.backing = "memory") is charged to the
                # unit as shmem, and the daemon counts it as its own KV in memory (M_kv,mem, out of M_anon+shmem)
                assert s["shmem_bytes"] >= 2 * KPU and s["own_kv_memory_bytes"] == 2 * KPU
                assert s["own_kv_bytes"] == 0
                assert s["mapped_bytes"] == max(0, s["file_mapped_bytes"] - s["shmem_bytes"] - s["own_kv_bytes"])
                run("systemctl", "set-property", "--runtime", "bladed.service", "MemoryHigh=infinity")
                s = admin.budget()["sample"]
                assert (s["memory_limit_bytes"], s["memory_limit_source"]) == (400 * MiB, f"{CGROUP}/memory.max"), s

                # -- reload: re-reads the file, applies what it can ----------------------------------
                CONFIG.write_text(config(lba, log={"level": "debug"}, budget={"cap": "1G"}))
                reload = journal.mark()
                run("systemctl", "reload", "bladed.service")
                applied = journal.wait(r"event=reload applied=(\S+)", after=reload).group(1).split(",")
                assert {"log.level", "budget.cap"} <= set(applied), applied
                assert show("bladed.service", "MainPID")["MainPID"] == str(pid)

                # -- stop with the session open: drain, TRIM, remove the page-cache files ------------
                stop = journal.mark()
                run("systemctl", "stop", "bladed.service")
                closed = journal.wait(r"event=session_close .*reason=shutdown.* trimmed_bytes=(\d+)", after=stop)
                assert int(closed.group(1)) == ext["nblocks"] * lba
                journal.wait(r"event=daemon_stop ", after=stop)
        p = show("bladed.service", "ActiveState", "Result", "ExecMainStatus")
        assert (p["ActiveState"], p["Result"], p["ExecMainStatus"]) == ("inactive", "success", "0"), p
    # QEMU's namespace reads zeroes after a deallocate (DLFEAT 1)
    assert read_extent(ext, lba) == bytes(ext["nblocks"] * lba)
    assert not os.path.exists(SOCKET)
    assert not list(Path("/var/lib/bladed/pagecache").iterdir())
    journal_json = json.loads(Path("/var/lib/bladed/journal.json").read_text())
    assert journal_json["sessions"] == []


def test_metrics_on_tcp_with_the_dropin(stopped: dict[str, Any]) -> None:
    def network() -> tuple[str, set[str]]:
        p = show("bladed.service", "PrivateNetwork", "RestrictAddressFamilies")
        return p["PrivateNetwork"], set(p["RestrictAddressFamilies"].split())

    # as shipped: no network namespace of the host's, Unix sockets only
    assert network() == ("yes", {"AF_UNIX"})
    shutil.copyfile(DROPINS / "metrics-tcp.conf", ETC_DROPINS / "metrics-tcp.conf")
    try:
        run("systemctl", "daemon-reload")
        assert network() == ("no", {"AF_UNIX", "AF_INET", "AF_INET6"})
        CONFIG.write_text(config(stopped["lba"], metrics={"enabled": True, "listen": "127.0.0.1:9477"}))
        start("bladed.service")
        with urllib.request.urlopen("http://127.0.0.1:9477/metrics", timeout=TIMEOUT) as r:
            assert r.status == 200 and b"bladed_sessions " in r.read()
        run("systemctl", "stop", "bladed.service")
    finally:
        (ETC_DROPINS / "metrics-tcp.conf").unlink()
        run("systemctl", "daemon-reload")


#: the slice the spike test puts bladed in, beside a neighbour's scope: its MemoryMax= binds both (no "-" in the
#: name: systemd would nest it in bladed.slice)
SPIKE_SLICE = "bladedspike.slice"
#: 8 MiB KPUs, 3 layers: 48 MiB of KV, every KPU in memory files
SPIKE_GEOMETRY = dict(GEOMETRY, max_tokens=2048)


def test_a_neighbour_in_the_slice_lives_beside_memory_kv(stopped: dict[str, Any]) -> None:
    """Issue 46 under systemd: bladed.service in a slice with ``MemoryMax=`` (a slice above it, as an operator sets
    one), a neighbour in a scope of the same slice growing at 50 MiB/s by 35% of the limit. bladed's own cgroup
    has no limit: the slice's binds, and the neighbour's memory counts against it; the memory watch (v2: the
    slice's usage, its memory.events) sees the growth and bladed demotes before the OOM killer would act."""
    (ETC_DROPINS / "test-slice.conf").write_text(f"[Service]\nSlice={SPIKE_SLICE}\n")
    CONFIG.write_text(config(stopped["lba"], measured=True))
    neighbour: subprocess.Popen[str] | None = None
    try:
        run("systemctl", "daemon-reload")
        with JournalWatch("bladed.service") as journal:
            start("bladed.service")
            slice_cg = "/sys/fs/cgroup" + show(SPIKE_SLICE, "ControlGroup")["ControlGroup"]
            with Client(SOCKET) as admin:
                st = admin.status()
                assert st["budget"]["cgroup"] == f"{slice_cg}/bladed.service", st["budget"]
                sess = admin.open_session(SPIKE_GEOMETRY, channels=1)
                assert {k["path"] for k in sess.plan["kpus"]} == {"pagecache"}, sess.plan
                for layer in range(SPIKE_GEOMETRY["layers"]):
                    for kind in "kv":
                        sess.slot(0)[:] = pattern(7, layer, kind, sess.kpu_bytes)
                        sess.write(layer, kind, 0)
                limit = int(Path(slice_cg, "memory.current").read_text()) + 40 * MiB
                run("systemctl", "set-property", "--runtime", SPIKE_SLICE, f"MemoryMax={limit}")
                s = admin.budget()["sample"]          # a sample of the new limit: the watch arms for it
                assert (s["binding_cgroup"], s["memory_limit_bytes"]) == (slice_cg, limit), s
                assert f"poll:{slice_cg}" in admin.stats()["replan"]["sources"]
                before = journal.mark()
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "bench")]))
                grow = int(0.35 * limit)
                neighbour = subprocess.Popen(
                    ["systemd-run", "--scope", "--quiet", f"--slice={SPIKE_SLICE}", sys.executable, "-m",
                     "bladed_bench.spike", "neighbour", str(grow), str(50 * MiB), str(1 * MiB)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                assert neighbour.stdin is not None and neighbour.stdout is not None
                assert neighbour.stdout.readline().strip() == "ready"
                neighbour.stdin.write("go\n")
                neighbour.stdin.flush()
                held = neighbour.stdout.readline().strip()
                assert held.startswith("held "), f"the neighbour died growing by {grow >> 20} MiB: {held!r}"
                journal.wait(r"event=kpu_demoted ", after=before)
                deadline = time.monotonic() + TIMEOUT
                while any(r.get("pending_demotions") for r in admin.sessions()):
                    assert time.monotonic() < deadline, "demotions still pending"
                    time.sleep(0.05)          # the demotion worker has no event a client can wait on
                assert neighbour.poll() is None
                events = dict(ln.split() for ln in Path(slice_cg, "memory.events").read_text().splitlines())
                assert events["oom_kill"] == "0", events
                replans = [ln for ln in journal.lines[before:journal.mark()] if "event=replan " in ln]
                # the watch saw the growth first (threshold or pressure); while the neighbour grows on, a periodic
                # sample may come before the next threshold and demote more, which is the backstop doing its job
                reasons = [m.group(1) if (m := re.search(r"reason=(\w+)", ln)) else None for ln in replans]
                assert reasons and reasons[0] in ("threshold", "pressure"), reasons
                assert set(reasons) <= {"threshold", "pressure", "periodic"}, reasons
                rep = admin.stats()["replan"]
                assert rep["demoted_kpus"] >= 1 and rep["demotions_failed"] == 0
                assert rep["demoted_bytes"] <= grow + s["free_bytes"]
                # every byte, on whichever path
                for layer in range(SPIKE_GEOMETRY["layers"]):
                    for kind in "kv":
                        sess.slot(0)[:] = bytes(sess.kpu_bytes)
                        sess.read(layer, kind, 0)
                        assert bytes(sess.slot(0)) == pattern(7, layer, kind, sess.kpu_bytes), f"{kind}{layer}"
                sess.close()
    finally:
        if neighbour is not None and neighbour.poll() is None:
            neighbour.communicate("exit\n", timeout=TIMEOUT)
        run("systemctl", "stop", "bladed.service")
        run("systemctl", "set-property", "--runtime", SPIKE_SLICE, "MemoryMax=infinity", check=False)
        (ETC_DROPINS / "test-slice.conf").unlink()
        CONFIG.write_text(config(stopped["lba"]))
        run("systemctl", "daemon-reload")
