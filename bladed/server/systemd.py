"""What bladed tells systemd and journald: ``sd_notify`` lines and log records
in journald's ``<priority>message`` form (see docs/operations.md)."""

from __future__ import annotations

import logging
import os
import socket
import sys

from bladed.config import Config

log = logging.getLogger("bladed")

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def sd_notify(*items: str) -> bool:
    """Send ``READY=1``-style lines to ``$NOTIFY_SOCKET``; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(items).encode(), addr)
        return True
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", addr, e)
        return False


class JournalFormatter(logging.Formatter):
    """``<prio>message``: journald takes the priority from the prefix and adds its own timestamp."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record).replace("\n", " | ")
        return f"<{_PRIORITY.get(record.levelno, 6)}>{msg}"


def under_journald() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM"))


def setup_logging(cfg: Config) -> None:
    """One stderr handler: journald's form under systemd (``log.format``), timestamps otherwise."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    fmt = cfg.log.format
    if fmt == "journal" or (fmt == "auto" and under_journald()):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(cfg.log.level.upper())


__all__ = ["JournalFormatter", "sd_notify", "setup_logging", "under_journald"]
