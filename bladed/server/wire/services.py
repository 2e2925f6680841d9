"""What a connection asks of the daemon: the narrow interface the wire wing sees instead of the daemon."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from bladed.config import Config
from bladed.io import ExtentDevice
from bladed.server.blocks.store import BlockStore
from bladed.server.events import Peer
from bladed.server.metrics import Stats
from bladed.server.sessions.manager import SessionManager


class Services(Protocol):
    """What a connection asks of the daemon (``daemon.core.Daemon``): its sessions, counters and reports."""

    cfg: Config
    device: ExtentDevice
    manager: SessionManager
    blocks: BlockStore
    stats: Stats
    stopping: threading.Event

    def status(self) -> dict[str, Any]: ...

    def gauges(self) -> dict[str, Any]: ...

    def budget(self) -> dict[str, Any]: ...

    def wear_report(self) -> dict[str, Any]: ...

    def trim_region(self) -> dict[str, Any]: ...

    def is_admin(self, peer: Peer) -> bool: ...

    def forget(self, conn: Any) -> None:
        """The connection ``conn`` has ended."""


__all__ = ["Services"]
