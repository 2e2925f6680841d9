"""``key=value`` log lines (logfmt): how a value is written, and how a log call adds fields.

A leaf module (it imports nothing of bladed), so every layer can attach fields
to its log records: ``log.info("session plan", extra=fields(session=sid, group1_layers=3))``.
The daemon's formatter (:class:`bladed.server.daemon.systemd.LogfmtFormatter`) writes
them after ``msg=``; docs/operations.md ("Logs") describes the line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: the LogRecord attribute that carries a record's fields (``extra=fields(...)``)
FIELDS = "fields"
#: the LogRecord attribute that makes a record a structured event (``event=NAME`` instead of ``msg=``)
EVENT = "logfmt_event"


def fields(**kv: Any) -> dict[str, Any]:
    """The ``extra=`` of a log call whose record carries ``kv`` as ``key=value`` fields."""
    return {FIELDS: kv}


def quote(value: Any) -> str:
    """A value as logfmt writes it: bare if it is one plain token, else a JSON (double-quoted) string."""
    s = str(value)
    if s and not any(c in ' ="\\' or not c.isprintable() for c in s):
        return s
    # JSON escapes '"', '\\' and control characters (a traceback stays on one line)
    return json.dumps(s, ensure_ascii=False)


def render(pairs: Mapping[str, Any]) -> str:
    """``k1=v1 k2=v2 ...`` in the mapping's order."""
    return " ".join(f"{k}={quote(v)}" for k, v in pairs.items())


__all__ = ["EVENT", "FIELDS", "fields", "quote", "render"]
