"""``bladed.spawn.PrivateDaemon`` as a context manager: entering starts the daemon (once, also after an
explicit ``start()``), leaving stops it however the block is left (docs/client.md, "A private daemon")."""

from __future__ import annotations

import os

import pytest
from daemon_util import env_with_repo, short_tmpdir

from bladed.client import Client
from bladed.spawn import PrivateDaemon


def test_entering_the_with_block_starts_the_daemon_and_leaving_stops_it() -> None:
    with short_tmpdir() as tmp:
        with PrivateDaemon(["--state-dir", tmp], env=env_with_repo(), log_path=os.path.join(tmp, "d.log")) as d:
            assert d.proc is not None and d.proc.poll() is None
            d.wait_ready(60)
            with Client(os.path.join(tmp, "bladed.sock")) as c:
                assert c.status()["pid"] == d.pid
        assert d.proc.returncode == 0, d.log_tail()          # SIGTERM: a graceful stop
        assert d.notify_socket is None


def test_a_daemon_started_before_the_block_is_not_started_again_and_an_error_stops_it() -> None:
    with short_tmpdir() as tmp:
        d = PrivateDaemon(["--state-dir", tmp], env=env_with_repo(), log_path=os.path.join(tmp, "d.log"))
        with pytest.raises(RuntimeError, match="inside"), d.start() as entered:
            proc = d.proc
            assert entered is d
            d.wait_ready(60)
            raise RuntimeError("inside the block")
        assert d.proc is proc and proc is not None and proc.returncode == 0, d.log_tail()
