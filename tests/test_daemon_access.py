"""Access control against a real daemon: SO_PEERCRED allow-lists (changed
live with SIGHUP), per-connection session isolation, per-uid quotas and
admin-only ops."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator

import pytest
from daemon_util import DaemonProcess, run_as, short_tmpdir, toml_text

from bladed.client import Client, NoSuchSessionError, QuotaExceededError
from bladed.protocol import BusyError, NoSpaceError

GEOMETRY = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 8}
KPU = 8 * 4096
NOBODY = 65534


@pytest.fixture
def tmp() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


def as_uid(uid: int, socket_path: str, action: str) -> dict:
    """``status``, ``trim`` or ``sessions`` as ``uid``; what it got."""
    def act(c: Client, out: dict) -> None:
        if action == "status":
            out["status"] = c.status()["version"]
        elif action == "trim":
            c.trim()
        elif action == "sessions":
            out["sessions"] = c.sessions()

    return run_as(uid, socket_path, act)


@pytest.mark.root
def test_uid_not_allowed_is_refused_until_allowed_by_reload(tmp: str) -> None:
    cfg = {"socket": {"mode": 0o666}}
    with DaemonProcess(tmp, cfg).start() as d:
        # the socket is world-connectable here, so the refusal comes from the peer-credential check
        assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o666
        refuse = d.mark()
        got = as_uid(NOBODY, d.socket_path, "status")
        assert got["exception"] == "PermissionDeniedError"
        assert f"uid {NOBODY}" in got["message"] and "not allowed" in got["message"]
        d.wait_event("connection_refused", after=refuse, uid=NOBODY)

        d.config["access"] = {"allowed_uids": [NOBODY]}
        with open(d.config_path, "w") as f:
            f.write(toml_text(d.config))
        hup = d.signal(signal.SIGHUP)
        assert d.wait_event("reload", after=hup)["applied"] == "access.allowed_uids"
        assert as_uid(NOBODY, d.socket_path, "status") == {"uid": NOBODY, "status": "0.1.0"}
        # allowed to use bladed is not allowed to administer it
        got = as_uid(NOBODY, d.socket_path, "trim")
        assert got["exception"] == "PermissionDeniedError" and "may not trim" in got["message"]


@pytest.mark.root
def test_allowed_by_group_and_socket_mode_applied(tmp: str) -> None:
    cfg = {"socket": {"mode": 0o660, "group": str(NOBODY)}, "access": {"allowed_gids": [NOBODY]}}
    with DaemonProcess(tmp, cfg).start() as d:
        st = os.stat(d.socket_path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
        assert as_uid(NOBODY, d.socket_path, "sessions") == {"uid": NOBODY, "sessions": []}


def test_a_session_cannot_address_another_sessions_tensors(tmp: str) -> None:
    with DaemonProcess(tmp).start() as d, Client(d.socket_path) as a, Client(d.socket_path) as b:
        sa = a.open_session(GEOMETRY, channels=1)
        sa.slot(0)[:] = b"A" * KPU
        sa.write(0, "k", 0)
        sb = b.open_session(GEOMETRY, channels=1)
        for op in ("read", "write"):
            with pytest.raises(NoSuchSessionError, match="no session"):
                b.call(op, session=sa.id, layer=0, kind="k", channel=0)
        with pytest.raises(NoSuchSessionError):
            b.call("close_session", session=sa.id)
        # b's own session of the same shape reads its own (empty) tensor, not a's
        sb.read(0, "k", 0)
        assert bytes(sb.slot(0)) != b"A" * KPU
        sa.slot(0)[:] = bytes(KPU)
        sa.read(0, "k", 0)
        assert bytes(sa.slot(0)) == b"A" * KPU


def test_per_uid_quota(tmp: str) -> None:
    per_session = 4 * KPU  # 2 layers x (K, V)
    cfg = {"access": {"quota_bytes": per_session + KPU}, "budget": {"override": 0}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        first = c.open_session(GEOMETRY, channels=1)
        with pytest.raises(QuotaExceededError, match="quota"):
            c.open_session(GEOMETRY, channels=1)
        first.close()
        c.open_session(GEOMETRY, channels=1).close()


def test_region_full_and_whole_region_trim(tmp: str) -> None:
    cfg = {"budget": {"override": 0}, "device": {"size": "1M"}}
    with DaemonProcess(tmp, cfg).start() as d, Client(d.socket_path) as c:
        s = c.open_session(dict(GEOMETRY, max_tokens=32), channels=1)       # 4 x 128 KiB: half the region
        with pytest.raises(NoSpaceError, match="region full"):
            c.open_session(dict(GEOMETRY, max_tokens=48), channels=1)   # 768 KiB more does not fit
        with pytest.raises(BusyError, match="session"):
            c.trim()  # the whole-region trim waits until no session is open
        s.close()
        assert c.trim()["trimmed_bytes"] == 1 << 20


@pytest.mark.root
def test_sessions_listing_is_per_uid_for_non_admins(tmp: str) -> None:
    with DaemonProcess(tmp, {"socket": {"mode": 0o666}, "access": {"allowed_uids": [NOBODY]}}).start() as d, \
            Client(d.socket_path) as root_client, root_client.open_session(GEOMETRY, channels=1) as s:
        assert [x["session"] for x in root_client.sessions()] == [s.id]
        assert as_uid(NOBODY, d.socket_path, "sessions")["sessions"] == []
