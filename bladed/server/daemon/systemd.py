"""What bladed tells systemd and journald: ``sd_notify`` lines, and its log as ``key=value``
lines, in journald's ``<priority>line`` form under systemd (see docs/operations.md, "Logs")."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from typing import Any

from bladed.config import Config
from bladed.logfmt import EVENT, FIELDS, render

log = logging.getLogger("bladed")

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


#: how long a notification may wait for room in the manager's queue before it is dropped (logged)
NOTIFY_TIMEOUT_S = 2.0


def sd_notify(*items: str) -> bool:
    """Send ``READY=1``-style lines to ``$NOTIFY_SOCKET``; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            # a manager that stopped reading (its queue full) must not stall the daemon's main loop
            s.settimeout(NOTIFY_TIMEOUT_S)
            s.sendto("\n".join(items).encode(), addr)
        return True
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", addr, e)
        return False


class LogfmtFormatter(logging.Formatter):
    """One ``key=value`` line per record (docs/operations.md, "Logs").

    ``level=info logger=bladed msg="..." k=v ...``, or ``... event=NAME k=v ...`` for
    :func:`bladed.server.events.event`; a record's ``extra=fields(...)`` come after ``msg``, a
    traceback as one quoted ``exc=`` value.  ``journal``: a ``<priority>`` prefix and no timestamp
    (journald takes the priority from it and stamps the line itself); otherwise ``ts=`` (UTC) first.
    """

    def __init__(self, journal: bool) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        head: dict[str, Any] = {}
        if not self.journal:
            ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            head["ts"] = ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        head["level"] = record.levelname.lower()
        head["logger"] = record.name
        name = getattr(record, EVENT, None)
        if name is not None:
            head["event"] = name
        else:
            head["msg"] = record.getMessage()
        extra = getattr(record, FIELDS, None)
        if isinstance(extra, dict):
            head.update({k: v for k, v in extra.items() if k not in head})
        if record.exc_info:
            head["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            head["stack"] = self.formatStack(record.stack_info)
        line = render(head)
        return f"<{_PRIORITY.get(record.levelno, 6)}>{line}" if self.journal else line


def under_journald() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM"))


def setup_logging(cfg: Config) -> None:
    """One stderr handler writing :class:`LogfmtFormatter` lines: journald's form under systemd
    (``log.format``), timestamps otherwise; the level is ``log.level``."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    fmt = cfg.log.format
    handler.setFormatter(LogfmtFormatter(journal=fmt == "journal" or (fmt == "auto" and under_journald())))
    root.addHandler(handler)
    root.setLevel(cfg.log.level.upper())


def report_error(message: str) -> None:
    """The one line for an error that stops bladed, on stderr.

    In journald's form (``log.format``, or before :func:`setup_logging` ran, ``JOURNAL_STREAM``):
    ``<3>level=error logger=bladed msg="..."``, so that the journal files it as an error; otherwise
    ``bladed: message`` for the person at the terminal.
    """
    formatter = next((h.formatter for h in logging.getLogger().handlers if isinstance(h.formatter, LogfmtFormatter)),
                     None)
    if formatter is not None and formatter.journal:
        log.error("%s", message)
    elif formatter is None and under_journald():
        record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
        print(LogfmtFormatter(journal=True).format(record), file=sys.stderr)
    else:
        print(f"bladed: {message}", file=sys.stderr)


__all__ = ["LogfmtFormatter", "report_error", "sd_notify", "setup_logging", "under_journald"]
