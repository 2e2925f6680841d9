"""Crash-recovery state in the state directory.

``journal.json`` lists what every open session holds on storage (its extents
and its page-cache directory), and every retained prefix (its key, its
extents and its page-cache directory; ``bladed.server.prefixes.cache``).  It is rewritten atomically (temp file,
fsync, rename, fsync of the directory) *before* a session is acknowledged and
after it is torn down, so after a crash (SIGKILL, power loss) the next
start-up knows exactly which extents to TRIM and which files to remove.
``bladed.lock`` (flock) keeps two daemons off the same state directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

JOURNAL = "journal.json"
LOCK = "bladed.lock"
#: 2: retained prefixes (a daemon that knows only 1 scrubs the whole region rather than miss their blocks)
JOURNAL_VERSION = 2
#: journals this build reads (1 has no retained prefixes)
READABLE_VERSIONS = (1, 2)
#: the ``mode`` of a journal record that holds blocks which could not be scrubbed (no live session)
QUARANTINED = "quarantined"


class StateLockedError(RuntimeError):
    """Another bladed holds the state directory."""


@dataclass
class SessionRecord:
    """What one session holds: enough to reclaim it without the session."""

    id: str
    uid: int
    pid: int
    mode: str
    #: (start LBA, blocks) of each extent
    extents: list[tuple[int, int]] = field(default_factory=list)
    #: the session's directory under the page-cache directory ("" = none)
    pagecache_dir: str = ""
    opened: float = field(default_factory=time.time)


#: ``state`` of a retained prefix whose KV is still being copied (reclaimed, never served, after a crash)
WRITING = "writing"
#: ``state`` of a retained prefix whose KV and checksums are complete
READY = "ready"


@dataclass
class RetainedRecord:
    """One retained prefix: its key, where its KV lies and how to rebuild its layout."""

    id: str
    scope: str
    model: str
    dtype: str
    #: hex of the key's seed (``bladed.server.prefixes.keys.seed_of``: model, dtype and KV shape)
    seed: str
    #: the geometry fields of the entry (``max_tokens`` = the tokens it holds; ``kv_format`` when named)
    geometry: dict[str, int | str]
    block_tokens: int
    #: the block hash chain (``bladed.server.prefixes.keys.block_chain``)
    hashes: list[str]
    #: the page-cache grant its plan was made with (Algorithm 1 with this grant gives its layout again)
    grant: int
    extents: list[tuple[int, int]] = field(default_factory=list)
    pagecache_dir: str = ""
    state: str = WRITING
    created: float = field(default_factory=time.time)


class Journal:
    """The on-disk list of live sessions, plus the daemon's exclusive lock."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, JOURNAL)
        self._lock_fd = -1
        self._records: dict[str, SessionRecord] = {}
        self._retained: dict[str, RetainedRecord] = {}
        self._mutex = threading.Lock()
        self.device: dict[str, Any] = {}

    def acquire(self) -> None:
        """Take the state directory for this process (StateLockedError if another daemon has it)."""
        os.makedirs(self.state_dir, mode=0o750, exist_ok=True)
        fd = os.open(os.path.join(self.state_dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateLockedError(f"another bladed (pid {holder or '?'}) is using the state directory "
                                       f"{self.state_dir}") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def load_stale(self) -> tuple[list[SessionRecord], list[RetainedRecord], dict[str, Any] | None]:
        """Sessions and retained prefixes a previous instance left, and the device it used; ([], [], None) if none.

        Raises ValueError if the journal exists but cannot be read (the caller
        then reclaims conservatively).
        """
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return [], [], None
        except (OSError, ValueError) as e:
            raise ValueError(f"unreadable journal {self.path}: {e}") from None
        if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"journal {self.path} has an unknown format")
        out = []
        for raw in data.get("sessions", []):
            try:
                raw["extents"] = [(int(s), int(n)) for s, n in raw.get("extents", [])]
                out.append(SessionRecord(**raw))
            except (TypeError, ValueError) as e:
                raise ValueError(f"journal {self.path}: bad session entry {raw!r}: {e}") from None
        retained = []
        for raw in data.get("retained", []):
            try:
                raw["extents"] = [(int(s), int(n)) for s, n in raw.get("extents", [])]
                retained.append(RetainedRecord(**raw))
            except (TypeError, ValueError) as e:
                raise ValueError(f"journal {self.path}: bad retained entry {raw!r}: {e}") from None
        return out, retained, data.get("device")

    def reset(self, device: dict[str, Any], retained: Sequence[RetainedRecord] = ()) -> None:
        """Start a fresh journal for this instance (after reclaiming the stale one), keeping ``retained``."""
        with self._mutex:
            self.device = device
            self._records = {}
            self._retained = {r.id: r for r in retained}
            self._write()

    def add(self, rec: SessionRecord) -> None:
        with self._mutex:
            self._records[rec.id] = rec
            self._write()

    def remove(self, session_id: str) -> None:
        with self._mutex:
            if self._records.pop(session_id, None) is not None:
                self._write()

    def add_retained(self, rec: RetainedRecord) -> None:
        with self._mutex:
            self._retained[rec.id] = rec
            self._write()

    def remove_retained(self, entry_id: str) -> None:
        with self._mutex:
            if self._retained.pop(entry_id, None) is not None:
                self._write()

    def _write(self) -> None:
        data = {"version": JOURNAL_VERSION, "pid": os.getpid(), "device": self.device,
                "sessions": [asdict(r) for r in self._records.values()],
                "retained": [asdict(r) for r in self._retained.values()]}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
