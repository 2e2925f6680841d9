"""Who is on the other end of a connection, and the daemon's structured events.

A leaf module: everything in :mod:`bladed.server` may import it, it imports
nothing of the server.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from bladed.logfmt import EVENT, FIELDS, render

events = logging.getLogger("bladed.events")


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return cls(pid=pid, uid=uid, gid=gid)

    def groups(self) -> set[int]:
        """The peer's supplementary groups (from ``/proc/<pid>/status``; empty if it is gone)."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        return {int(g) for g in line.split()[1:]}
        except (OSError, ValueError):
            pass
        return set()

    @property
    def is_self(self) -> bool:
        return self.uid in (0, os.getuid())


def event(name: str, **fields: Any) -> None:
    """One structured log line at INFO: ``event=NAME key=value ...`` (docs/operations.md, "Logs")."""
    # the formatter writes event= and the fields itself (no msg=); the message is for any other handler
    events.info("%s", render({"event": name, **fields}), extra={EVENT: name, FIELDS: fields})


__all__ = ["Peer", "event"]
