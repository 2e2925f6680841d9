"""Isolation and data remanence: a new session never reads bytes an earlier
session wrote, on the file backend (punched holes), on a loop block device
(discard), and with ``device.zero_freed = "always"`` (Write Zeroes on every
freed extent, what a device without DLFEAT zeroes gets); and a second,
unprivileged uid (nobody) can neither connect without permission nor reach
another uid's session.  The NVMe backend is covered in
``tests/vm/test_faults_in_vm.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, run_as, short_tmpdir
from remanence import GEO, KPU, remanence_round

from bladed.client import Client

NOBODY = 65534


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


@pytest.mark.parametrize("zero_freed", ["auto", "always"])
def test_file_backend_new_session_never_reads_old_bytes(tmp: str, zero_freed: str) -> None:
    cfg = {"device": {"size": "8M", "zero_freed": zero_freed}, "budget": {"override": 2 * KPU}}
    with DaemonProcess(tmp, cfg).start() as d:
        rounds = d.mark()
        for mode in ("direct", "dualblade", "baseline"):
            st = remanence_round(d, mode)
        if zero_freed == "always":
            assert st["zeroed_bytes"] > 0
            # a close's line may still be in the pipe when its reply is in: awaited, not looked up
            d.wait_fields(lambda f: f.get("event") == "session_close" and int(f.get("zeroed_bytes", "0")) > 0,
                          after=rounds)
        else:
            # punched holes read back as zeroes: no Write Zeroes needed
            assert st["zeroed_bytes"] == 0 and st["trimmed_bytes"] > 0


@pytest.mark.root
@pytest.mark.parametrize("zero_freed", ["auto", "always"])
def test_block_backend_new_session_never_reads_old_bytes(tmp: str, loop_device: str, zero_freed: str) -> None:
    cfg = {"device": {"backend": "block", "path": loop_device, "zero_freed": zero_freed},
           "budget": {"override": 0}}
    with DaemonProcess(tmp, cfg).start() as d:
        st = remanence_round(d, "direct")
        assert st["trimmed_bytes"] > 0
        assert (st["zeroed_bytes"] > 0) == (zero_freed == "always")


def test_invalid_zero_freed_is_named(tmp: str) -> None:
    from bladed.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"device\.zero_freed"):
        config_from_dict({"device": {"zero_freed": "never"}})


def as_nobody(socket_path: str, action: str, arg: str = "") -> dict:
    """``status``, ``read_other`` (session ``arg``) or ``fresh_read`` as uid/gid 65534; what it got."""
    def act(c: Client, out: dict) -> None:
        if action == "read_other":
            c.call("read", session=arg, layer=0, kind="k", channel=0)
        elif action == "fresh_read":
            with c.open_session(GEO, mode="direct", channels=1) as s:
                out["extent"] = next(x for x in c.sessions() if x["session"] == s.id)["extent"]
                s.read(0, "k", 0)
                out["zeros"] = bytes(s.slot(0)) == bytes(KPU)
                out["sessions"] = [x["uid"] for x in c.sessions()]

    return run_as(NOBODY, socket_path, act)


@pytest.mark.root
def test_unprivileged_uid_cannot_connect_through_a_closed_socket(tmp: str) -> None:
    with DaemonProcess(tmp, {"socket": {"mode": 0o600}, "access": {"allowed_uids": [NOBODY]}}).start() as d:
        got = as_nobody(d.socket_path, "status")
        # the filesystem permission stops it before the daemon sees a byte
        assert got["exception"] == "PermissionDeniedError" and d.socket_path in got["message"], got
        assert not d.events("connection_refused")


@pytest.mark.root
def test_unprivileged_tenant_reaches_neither_root_sessions_nor_their_old_bytes(tmp: str) -> None:
    cfg = {"socket": {"mode": 0o666}, "access": {"allowed_uids": [NOBODY]}, "budget": {"override": 0}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as root:
        s = root.open_session(GEO, mode="direct", channels=1)
        ext = next(x for x in root.sessions() if x["session"] == s.id)["extent"]
        s.slot(0)[:] = b"\xcd" * KPU
        s.write(0, "k", 0)
        got = as_nobody(d.socket_path, "read_other", s.id)
        assert got["exception"] == "NoSuchSessionError" and got["uid"] == NOBODY
        s.close()
        got = as_nobody(d.socket_path, "fresh_read")
        assert got["extent"] == ext and got["zeros"] is True
        assert got["sessions"] == [NOBODY]   # root's sessions are not even listed
