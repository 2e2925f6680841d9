"""``bladectl`` against a running daemon (``--json`` parsed here), the storage commands on files
and loop devices, and what a user who gets something wrong sees: the real entry point, run as a
subprocess (``bladectl_util``), exits with a documented status and says the cause and the fix in
one line, or one JSON object with ``--json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import click
import pytest
from bladectl_util import bladectl as run
from bladectl_util import failure, one_line, one_object
from click.testing import CliRunner, Result
from daemon_util import ROOT, DaemonProcess, documented_exit_statuses, env_with_repo, short_tmpdir

from bladed.cli.bladectl import cli
from bladed.cli.common import EXIT_STATUSES
from bladed.client import Client, PrefixKey
from bladed.spawn import PrivateDaemon

GEOMETRY = {"layers": 4, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096
MISSING_NS = "/dev/ng97n97"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp, DaemonProcess(tmp, {"budget": {"override": 2 * KPU}}).start() as d:
        yield d


@pytest.fixture(scope="module")
def nowhere() -> Iterator[str]:
    """An empty working directory: no ./var/bladed/bladed.sock to find."""
    with short_tmpdir() as tmp:
        yield tmp


def bladectl(*args: str, socket: str | None = None, input: str | None = None) -> Result:
    pre = ["--socket", socket] if socket else []
    return CliRunner().invoke(cli, [*pre, *args], input=input, catch_exceptions=False)


def as_json(result: Result) -> dict:
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def test_status(daemon: DaemonProcess) -> None:
    st = as_json(bladectl("status", "--json", socket=daemon.socket_path))
    assert st["device"]["kind"] == "file" and st["device"]["lba_size"] == 4096
    assert st["region"] == {"start_lba": 0, "blocks": 16384, "bytes": 64 << 20}
    assert st["pid"] == daemon.pid and st["socket"] == daemon.socket_path
    human = bladectl("status", socket=daemon.socket_path).output
    assert "LBA 0 + 16384 blocks (64.0 MiB)" in human and f"pid {daemon.pid}" in human


def test_sessions_stats_budget_with_a_live_session(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEOMETRY, channels=2) as s:
        for layer in range(4):
            s.write(layer, "k", 0)
        s.read(0, "k", 1)
        rows = json.loads(bladectl("sessions", "--json", socket=daemon.socket_path).output)
        (row,) = [r for r in rows if r["session"] == s.id]
        assert (row["mode"], row["channels"], row["group1_layers"], row["ops"]) == ("dualblade", 2, 1, 5)
        assert row["extent"]["nblocks"] == 6 * KPU // 4096 and row["pid"] == os.getpid()
        assert s.id in bladectl("sessions", socket=daemon.socket_path).output

        st = as_json(bladectl("stats", "--json", socket=daemon.socket_path))
        assert st["io"]["direct"]["write"]["ops"] >= 3 and st["io"]["direct"]["write"]["bytes"] >= 3 * KPU
        assert st["io"]["pagecache"]["read"]["ops"] >= 1 and st["pagecache"]["hit_ratio"] == 1.0
        assert st["sessions"] >= 1 and st["extents"]["used_blocks"] >= 6 * KPU // 4096

        b = as_json(bladectl("budget", "--json", socket=daemon.socket_path))
        for term in ("host_available_bytes", "memory_limit_bytes", "anon_shmem_bytes", "usable_bytes", "copy_threads",
                     "pinned_per_thread_bytes", "pinned_bytes", "pagecache_budget_bytes"):
            assert term in b["sample"], term
        assert b["sample"]["pagecache_budget_bytes"] == b["override_bytes"] == 2 * KPU
        (mine,) = [x for x in b["sessions"] if x["session"] == s.id]
        assert (mine["channels"], mine["pinned_per_thread_bytes"], mine["budget_bytes"]) == (2, KPU, 2 * KPU)
        assert (mine["group1_limit_bytes"], mine["group1_layers"], mine["group1_bytes"]) == (2 * KPU, 1, 2 * KPU)
        human = bladectl("budget", socket=daemon.socket_path).output
        assert "[Eq. 1" in human and "[Eq. 2]" in human and f"session {s.id}" in human


def test_stats_watch_prints_one_json_object_per_refresh(daemon: DaemonProcess) -> None:
    r = bladectl("stats", "--watch", "--json", "--count", "3", "--interval", "0.01", socket=daemon.socket_path)
    lines = [json.loads(x) for x in r.output.splitlines()]
    assert len(lines) == 3 and lines[0]["time"] <= lines[2]["time"]
    r = bladectl("stats", "--watch", "--count", "2", "--interval", "0.01", socket=daemon.socket_path)
    assert r.output.count("page-cache hit ratio") == 2 and "MB/s" in r.output


def test_trim_only_without_sessions(daemon: DaemonProcess, nowhere: str) -> None:
    with Client(daemon.socket_path) as c, c.open_session(GEOMETRY, channels=1):
        r = run("trim", "--yes", "--socket", daemon.socket_path, cwd=nowhere)
        assert "session(s) open" in one_line(r, 1)
    # not confirmed: the question went to stderr, stdout holds only the JSON failure
    r = run("--json", "trim", "--socket", daemon.socket_path, cwd=nowhere, input="n\n")
    assert "not confirmed" in failure(r, 1, "not_confirmed") and "TRIM the whole KV region" in r.stderr
    t = as_json(bladectl("trim", "--yes", "--json", socket=daemon.socket_path))
    assert t["trimmed_bytes"] == 64 << 20 and t["blocks"] == 16384


def retain_prompts(socket: str, prompts: list[list[int]]) -> list[str]:
    """Retain each prompt's KV (written as zeros) under the model "tiny-model"; the entry ids."""
    geo = {"layers": 2, "batch": 1, "kv_heads": 2, "head_dim": 64, "dtype_bytes": 2, "max_tokens": 32}
    ids = []
    with Client(socket) as c:
        for tokens in prompts:
            s = c.open_session(geo, channels=1, prefix=PrefixKey("tiny-model", "float16", tokens))
            for layer in range(2):
                for kind in "kv":
                    s.write(layer, kind, 0, 0, len(tokens))
            ids.append(s.retain(tokens, close=True)["entry"])
        with c.open_session(geo, channels=1, prefix=PrefixKey("tiny-model", "float16", prompts[0])) as s:
            assert s.prefix_tokens == 16                                # a hit on the first one
    return ids


def test_prefixes_lists_and_evicts_the_retained_prefixes(daemon: DaemonProcess, nowhere: str) -> None:
    sock = daemon.socket_path
    first, second = retain_prompts(sock, [[1000 + i for i in range(20)], [2000 + i for i in range(20)]])
    listed = as_json(bladectl("prefixes", "--json", socket=sock))
    assert listed["scope"] == f"uid:{os.getuid()}" and listed["block_tokens"] == 16
    by_id = {e["entry"]: e for e in listed["prefixes"]}
    assert set(by_id) == {first, second}
    e = by_id[first]
    assert (e["model"], e["dtype"], e["tokens"], e["hits"], e["in_use"]) == ("tiny-model", "float16", 16, 1, 0)
    assert e["pagecache_bytes"] + e["device_bytes"] == 4 * 16 * 256    # 4 KPUs of 16 rows of 256 bytes
    human = bladectl("prefixes", socket=sock).output
    assert human.startswith(f"scope uid:{os.getuid()}, blocks of 16 tokens: 2 retained prefixes\n")
    assert "LAST USED" in human and "MODEL" in human
    (row,) = [line for line in human.splitlines() if line.startswith(first)]
    assert row.split()[1:3] == [f"uid:{os.getuid()}", "16"] and row.endswith(" tiny-model")

    assert as_json(bladectl("prefixes", "evict", first, "--json", socket=sock)) == {"evicted": [first]}
    gone = failure(run("prefixes", "evict", first, "--json", "--socket", sock, cwd=nowhere), 1, "bad_request")
    assert gone == f"no retained prefix {first!r} (see bladectl prefixes)"
    assert failure(run("prefixes", "evict", "--json", "--socket", sock, cwd=nowhere), 2, "usage") == (
        "give one retained prefix ENTRY or --all; see `bladectl prefixes evict --help`")
    assert one_line(run("prefixes", "evict", second, "--all", "--socket", sock, cwd=nowhere), 2) == (
        "give ENTRY or --all, not both; see `bladectl prefixes evict --help`")
    assert bladectl("prefixes", "evict", "--all", socket=sock).output == f"evicted 1 retained prefix: {second}\n"
    assert bladectl("prefixes", socket=sock).output == (
        f"scope uid:{os.getuid()}, blocks of 16 tokens: 0 retained prefixes\n")


def test_ns_list_on_a_host_without_nvme() -> None:
    data = as_json(bladectl("ns", "list", "--json"))
    assert data == {"controllers": [], "namespaces_without_controller": []}
    assert "no NVMe controllers found" in bladectl("ns", "list").output


def test_ns_check_of_a_store_file(store_dir: str, nowhere: str) -> None:
    new = os.path.join(store_dir, "new.img")
    ok = as_json(bladectl("ns", "check", new, "--size", "16M", "--json"))
    assert ok["ok"] and ok["usable"] and ok["backend"] == "file"
    assert {c["check"] for c in ok["checks"]} >= {"kernel", "io_uring", "cachestat", "memlock", "O_DIRECT"}
    no_size = failure(run("ns", "check", new, "--json", cwd=nowhere), 2, "no_size")
    assert no_size == f"{new} does not exist; give --size to have it created (e.g. --size 64G)"
    bad = failure(run("ns", "check", new, "--size", "12Q", "--json", cwd=nowhere), 2, "usage")
    assert "--size" in bad and "'12Q'" in bad and "see `bladectl ns check --help`" in bad


@pytest.mark.root
def test_ns_check_and_setup_on_a_loop_device(loop_device: str, store_dir: str) -> None:
    chk = as_json(bladectl("ns", "check", loop_device, "--json"))
    by = {c["check"]: c for c in chk["checks"]}
    assert chk["usable"] and chk["backend"] == "block"
    assert by["LBA size"]["status"] == "warn" and by["LBA size"]["detail"].startswith("512 bytes")
    assert by["read"]["status"] == "ok" and by["discard"]["status"] == "ok"
    r = bladectl("ns", "check", loop_device, "--region-start", str(1 << 30), "--json")
    out = json.loads(r.output)
    assert r.exit_code == 1 and not out["ok"] and out["error"]["code"] == "unusable"
    assert "past the end" in out["error"]["message"]

    cfg = os.path.join(store_dir, "etc", "bladed.toml")
    out = as_json(bladectl("ns", "setup", loop_device, "--region-start", "2048", "--state-dir", store_dir,
                           "--socket-path", "s.sock", "-o", cfg, "--json"))
    assert out["device"]["lba_size"] == 512 and out["systemd_dropin"].endswith(f"{loop_device} rw\n")
    check = subprocess.run([sys.executable, "-m", "bladed.server", "--config", cfg, "--check-config"], cwd=ROOT,
                           env=env_with_repo(), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert "configuration OK: block" in check.stdout and "region [2048," in check.stdout
    again = bladectl("ns", "setup", loop_device, "-o", cfg)
    assert again.exit_code == 1 and "--force" in again.output


def test_ns_setup_for_a_file_then_the_daemon_serves_it() -> None:
    with short_tmpdir() as tmp:
        cfg = os.path.join(tmp, "bladed.toml")
        r = bladectl("ns", "setup", os.path.join(tmp, "kv.img"), "--size", "32M", "--state-dir", tmp,
                     "--socket-path", "s.sock", "-o", cfg)
        assert r.exit_code == 0, r.output
        assert f"`bladectl -c {cfg}`" in r.output  # how clients find this daemon
        # `python -m bladed.server --config CFG`, ready at its READY=1 (a notify socket of this test's, as
        # systemd's); ended (SIGTERM, then SIGKILL) however the block is left
        with PrivateDaemon(["--config", cfg], env=env_with_repo(), cwd=ROOT,
                           log_path=os.path.join(tmp, "daemon.log")).start() as daemon:
            daemon.wait_ready(60)
            st = one_object(run("-c", cfg, "status", "--json", cwd=tmp))
            assert st["device"]["path"] == os.path.join(tmp, "kv.img") and st["region"]["bytes"] == 32 << 20
            assert daemon.stop() == 0, daemon.log_tail()


# -- what the new user found (docs/operations.md, bladectl) -------------------------------------
def test_global_options_go_before_or_after_the_command(daemon: DaemonProcess, nowhere: str) -> None:
    """`bladectl status --socket X` and `bladectl --json status` were "No such option"."""
    sock = daemon.socket_path
    cfg = daemon.config_path  # its socket.path is relative to its state dir: given with --state-dir
    for argv in (["status", "--socket", sock, "--json"], ["--json", "status", "--socket", sock],
                 ["--socket", sock, "--json", "status"], ["--json", "--socket", sock, "status"]):
        r = run(*argv, cwd=nowhere)
        assert r.returncode == 0, (argv, r.stderr)
        assert one_object(r)["pid"] == daemon.pid, argv
    human = run("status", "--socket", sock, cwd=nowhere)
    assert human.returncode == 0 and f"pid {daemon.pid}" in human.stdout
    r = run("ns", "--json", "check", MISSING_NS, cwd=nowhere)  # a group's options too
    assert "no such device" in failure(r, 2, "no_such_device")
    # -c takes the socket from a config file, before or after the command
    with open(os.path.join(nowhere, "c.toml"), "w") as f:
        f.write(f'[socket]\npath = "{sock}"\n')
    for argv in (["-c", "c.toml", "status", "--json"], ["status", "--config", "c.toml", "--json"]):
        assert one_object(run(*argv, cwd=nowhere))["socket"] == sock, (argv, cfg)


def test_every_json_failure_is_one_object_on_stdout(nowhere: str) -> None:
    missing = os.path.join(nowhere, "none.sock")
    msg = failure(run("--json", "status", "--socket", missing, cwd=nowhere), 3, "no_daemon")
    assert msg == (f"no bladed socket at {missing} (given as --socket; start bladed there or give the path of "
                   "its socket)")
    assert failure(run("status", "--json", "--socket", missing, cwd=nowhere), 3, "no_daemon") == msg
    bogus = failure(run("status", "--json", "--bogus", cwd=nowhere), 2, "usage")
    assert bogus == "No such option '--bogus'; see `bladectl status --help`"
    assert "No such command 'bogus'" in failure(run("--json", "bogus", cwd=nowhere), 2, "usage")
    assert failure(run("--json", cwd=nowhere), 2, "usage") == "Missing command; see `bladectl --help`"
    bad_cfg = failure(run("--json", "-c", "nope.toml", "status", cwd=nowhere), 2, "config")
    assert bad_cfg == "-c nope.toml: config file nope.toml does not exist; give -c the config file bladed runs with"
    for argv in (["--json", "status", "--socket", missing], ["status", "--json", "--bogus"]):
        assert run(*argv, cwd=nowhere).stderr == ""  # nothing else, anywhere


def test_a_failure_is_one_line_and_a_traceback_only_with_debug(nowhere: str) -> None:
    missing = os.path.join(nowhere, "none.sock")
    line = one_line(run("status", "--socket", missing, cwd=nowhere), 3)
    assert line.startswith(f"no bladed socket at {missing} (given as --socket;")
    debug = run("status", "--socket", missing, "--debug", cwd=nowhere)
    assert debug.returncode == 3 and "Traceback" in debug.stderr and debug.stderr.rstrip().endswith(line)
    bogus = one_line(run("status", "--bogus", cwd=nowhere), 2)
    assert bogus == "No such option '--bogus'; see `bladectl status --help`"


def _words(text: str) -> str:
    return " ".join(text.split())


def test_help_shows_every_summary_whole_and_the_exit_statuses(nowhere: str) -> None:
    """`bladectl --help` showed `budget  Every term of Eq.` (click cuts at the first period)."""
    top = run("--help", cwd=nowhere)
    assert top.returncode == 0
    text = _words(top.stdout)
    assert "budget Every term of the page-cache budget (Eq. 1-2) and what each session was granted." in text
    groups: list[click.Group] = [cli]
    while groups:
        group = groups.pop()
        shown = text if group is cli else _words(run(str(group.name), "--help", cwd=nowhere).stdout)
        for name, cmd in group.commands.items():
            assert cmd.short_help and f"{name} {cmd.short_help}" in shown, (group.name, name)
            if isinstance(cmd, click.Group):
                groups.append(cmd)
    for status, meaning in EXIT_STATUSES:
        assert f"{status} {meaning}" in text


def test_exit_statuses_are_documented() -> None:
    assert documented_exit_statuses("bladectl status") == {status for status, _ in EXIT_STATUSES}


def test_a_missing_dev_path_is_never_a_file_store(nowhere: str) -> None:
    """`ns check /dev/ng0n1` (no such device) took the file backend; with --size it said "usable",
    and `ns setup` wrote backend = "file", path = "/dev/ng0n1"."""
    expected = f"no such device {MISSING_NS}; see `bladectl ns list`"
    assert one_line(run("ns", "check", MISSING_NS, cwd=nowhere), 2) == expected
    assert one_line(run("ns", "check", MISSING_NS, "--size", "1G", cwd=nowhere), 2) == expected
    assert one_line(run("ns", "check", MISSING_NS, "--size", "1G", "--backend", "file", cwd=nowhere), 2) == expected
    assert failure(run("ns", "check", MISSING_NS, "--json", cwd=nowhere), 2, "no_such_device") == expected
    cfg = os.path.join(nowhere, "bladed.toml")
    assert one_line(run("ns", "setup", MISSING_NS, "--size", "1G", "-o", cfg, cwd=nowhere), 2) == expected
    assert not os.path.exists(cfg)
    # nor is a plain file under /dev; a directory or a char device that is no namespace is no store
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        assert f"{f.name} is a plain file under /dev, not a device" in one_line(
            run("ns", "check", f.name, "--size", "1G", cwd=nowhere), 2)
    assert one_line(run("ns", "check", "/dev/shm", cwd=nowhere), 2).startswith("/dev/shm is a directory;")
    assert "/dev/null is a character device but not an NVMe namespace (/dev/ngXnY)" in one_line(
        run("ns", "check", "/dev/null", cwd=nowhere), 2)


def _root_disk() -> str:
    """The block device node the root filesystem is mounted from."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == "/":
                name = os.path.basename(os.path.realpath(f"/sys/dev/block/{fields[2]}"))
                return f"/dev/{name}"
    raise AssertionError("no root mount in /proc/self/mountinfo")


def test_the_mounted_root_disk_is_in_use(nowhere: str) -> None:
    """`ns check /dev/vda` (the mounted root disk) said `[Errno 1] Operation not permitted`.
    Read-only: bladectl decides from /proc/self/mountinfo before opening anything."""
    disk = _root_disk()
    assert os.path.exists(disk), disk
    line = one_line(run("ns", "check", disk, cwd=nowhere), 1)
    assert line.startswith(f"{disk} is in use: mounted at /") and "Errno" not in line
    assert line.endswith("; give bladed a device nothing else uses (`bladectl ns list`)")
    assert failure(run("--json", "ns", "check", disk, cwd=nowhere), 1, "in_use") == line
    cfg = os.path.join(nowhere, "root.toml")
    assert one_line(run("ns", "setup", disk, "-o", cfg, cwd=nowhere), 1) == line and not os.path.exists(cfg)
    assert one_line(run("ns", "check", disk, "--backend", "file", cwd=nowhere), 2) == (
        f"{disk} is a block device, not what --backend file uses; give --backend block (or leave --backend auto)")
    # --backend nvme takes a block node only if it is a whole NVMe namespace the kernel gives no /dev/ngXnY
    line = one_line(run("ns", "check", disk, "--backend", "nvme", cwd=nowhere), 2)
    assert line.startswith(f"{disk} (") and line.endswith("is not an NVMe namespace (want /dev/ngXnY, or "
                                                          "/dev/nvmeXnY before Linux 5.13)"), line


@pytest.mark.root
def test_a_mounted_swapped_or_claimed_loop_device_is_in_use(store_dir: str, loop_device: str, nowhere: str) -> None:
    mnt = os.path.join(store_dir, "mnt")
    os.makedirs(mnt)
    subprocess.run(["mkfs.ext4", "-q", "-F", loop_device], check=True)
    subprocess.run(["mount", loop_device, mnt], check=True)
    try:
        assert one_line(run("ns", "check", loop_device, cwd=nowhere), 1).startswith(
            f"{loop_device} is in use: mounted at {mnt};")
    finally:
        subprocess.run(["umount", mnt], check=True)
    subprocess.run(["mkswap", "-q", loop_device], check=True, capture_output=True)
    subprocess.run(["swapon", loop_device], check=True)
    try:
        assert one_line(run("ns", "check", loop_device, cwd=nowhere), 1).startswith(
            f"{loop_device} is in use: used as swap;")
    finally:
        subprocess.run(["swapoff", loop_device], check=True)
    fd = os.open(loop_device, os.O_RDONLY | os.O_EXCL)  # what mkfs, a VM or another daemon does
    try:
        line = one_line(run("ns", "check", loop_device, cwd=nowhere), 1)
        assert line.startswith(f"{loop_device} is in use: opened exclusively by pid {os.getpid()} ("), line
    finally:
        os.close(fd)
    assert run("ns", "check", loop_device, cwd=nowhere).returncode == 0  # free again


def test_the_store_of_a_live_daemon_is_in_use(daemon: DaemonProcess, nowhere: str) -> None:
    """`ns check` of the store file a live daemon uses said "usable by bladed"."""
    store = os.path.join(daemon.state_dir, "kv-store.img")
    expected = (f"{store} is in use by bladed pid {daemon.pid} (socket {daemon.socket_path}); "
                "stop that bladed first to set its store up again")
    assert one_line(run("ns", "check", store, cwd=nowhere), 1) == expected
    assert failure(run("ns", "check", store, "--json", cwd=nowhere), 1, "in_use") == expected
    cfg = os.path.join(nowhere, "again.toml")
    assert one_line(run("ns", "setup", store, "--size", "64M", "-o", cfg, cwd=nowhere), 1) == expected
    assert not os.path.exists(cfg)


@pytest.mark.root
def test_the_block_store_of_a_live_daemon_is_in_use(loop_device: str, nowhere: str) -> None:
    with short_tmpdir() as tmp, DaemonProcess(tmp, {"device": {"backend": "block", "path": loop_device,
                                                               "size": 0}}).start() as d:
        line = one_line(run("ns", "check", loop_device, cwd=nowhere), 1)
        assert line == (f"{loop_device} is in use by bladed pid {d.pid} (socket {d.socket_path}); "
                        "stop that bladed first to set its store up again")


def test_ns_setup_prints_the_shipped_device_dropin_for_its_device() -> None:
    """The drop-in `ns setup` prints is systemd/dropins/nvme-device.conf for the device it set up, with
    systemd's own escaping of the device unit's name."""
    import shutil

    from bladed.cli.ns import device_dropin, systemd_escape_path

    for path in ("/dev/bladed/kv", "/dev/ng0n1", "/dev/disk/by-id/nvme-QEMU_NVMe_Ctrl_nvmevm0-1"):
        want = subprocess.run(["systemd-escape", "--path", path], capture_output=True, text=True, check=True)
        assert systemd_escape_path(path) == want.stdout.strip()
    assert shutil.which("systemd-escape")

    def directives(text: str) -> list[str]:
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    with open(os.path.join(ROOT, "systemd", "dropins", "nvme-device.conf")) as f:
        assert directives(device_dropin("/dev/bladed/kv")) == directives(f.read())
