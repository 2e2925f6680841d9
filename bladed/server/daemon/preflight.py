"""What start-up needs from the machine, checked without changing anything (``bladed --check-config``).

Each problem is one line naming the configuration key, what is wrong and the
fix.  Start-up runs the same checks before it creates, binds or preallocates
anything, so an operator sees the same message from ``--check-config``, from
``systemctl start`` and from a terminal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from typing import Any

from bladed.config import Config
from bladed.io import open_device
from bladed.io.engines import EngineSettingError
from bladed.io.engines import choose as choose_engine
from bladed.server.storage.journal import LOCK


def _nearest_existing(path: str) -> str:
    """``path`` or its closest existing ancestor."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _writable(path: str) -> bool:
    """Can this process create entries in directory ``path`` (root included: read-only mounts)?"""
    if not os.access(path, os.W_OK | os.X_OK):
        return False
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def _writable_dir(key: str, path: str, *, may_create: bool) -> list[str]:
    """A directory the daemon writes in: there and writable, or (``may_create``) creatable."""
    if os.path.isdir(path):
        if not _writable(path):
            return [f"{key}: directory {path} is not writable by uid {os.getuid()} (permissions or a read-only "
                    f"file system); fix it or choose another {key}"]
        return []
    if os.path.exists(path):
        return [f"{key}: {path} exists and is not a directory; remove it or choose another {key}"]
    if not may_create:
        return [f"{key}: directory {path} does not exist; create it (the daemon creates only its state "
                "directory) or choose another path"]
    base = _nearest_existing(path)
    if not os.path.isdir(base) or not _writable(base):
        return [f"{key}: cannot create {path}: {base} is not a writable directory for uid {os.getuid()}; "
                f"create {path} or choose another {key}"]
    return []


def _inside(path: str, directory: str) -> bool:
    p, d = os.path.abspath(path), os.path.abspath(directory)
    return p == d or p.startswith(d.rstrip("/") + "/")


def check_paths(cfg: Config, *, live_socket: bool = True) -> list[str]:
    """State, page-cache and socket directories, the socket itself and the metrics address.

    ``live_socket``: also say if another process serves the socket (start-up learns that from the
    state directory's lock first, and from the socket when it binds).
    """
    problems = _writable_dir("daemon.state_dir", cfg.state_dir, may_create=True)
    state_ok = not problems          # else what lives in the state directory is that same problem: not repeated
    lock = os.path.join(cfg.state_dir, LOCK)
    if os.path.exists(lock) and not os.access(lock, os.R_OK | os.W_OK):
        problems.append(f"daemon.state_dir: {lock} is not writable by uid {os.getuid()}; a daemon of another user "
                        "owns this state directory")
    if not _inside(cfg.pagecache_dir, cfg.state_dir):
        problems += _writable_dir("daemon.pagecache_dir", cfg.pagecache_dir, may_create=True)
    sock_dir = os.path.dirname(os.path.abspath(cfg.socket_path))
    # the daemon creates its own state directory (and so a socket inside it), nothing else
    if state_ok or not _inside(sock_dir, cfg.state_dir):
        problems += _writable_dir("socket.path", sock_dir, may_create=_inside(sock_dir, cfg.state_dir))
    if os.path.exists(cfg.socket_path):
        if not stat.S_ISSOCK(os.stat(cfg.socket_path).st_mode):
            problems.append(f"socket.path: {cfg.socket_path} exists and is not a socket; remove it or choose another "
                            "socket.path")
        elif live_socket and _listening(cfg.socket_path):
            problems.append(f"socket.path: another process is serving {cfg.socket_path}; stop it or choose another "
                            "socket.path")
    if cfg.metrics.enabled:
        problems += _check_metrics(cfg)
    return problems


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _check_metrics(cfg: Config) -> list[str]:
    _, where = cfg.metrics_target
    if isinstance(where, str):
        sock_dir = os.path.dirname(os.path.abspath(where))
        return _writable_dir("metrics.listen", sock_dir, may_create=_inside(sock_dir, cfg.state_dir))
    host, port = where
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return [f"metrics.listen: {host}:{port} is already in use (another bladed or exporter?); choose "
                        "another port or set metrics.enabled = false"]
            return [f"metrics.listen: cannot listen on {host}:{port}: {e.strerror}; choose another address"]
    return []


def check_device(cfg: Config) -> tuple[list[str], str]:
    """The device, opened only if it exists (a missing store file is not created), and its engine.

    Returns the problems and a one-line description of what start-up will use.
    """
    try:
        engine = choose_engine(cfg.io.engine, cfg.device.backend)
    except EngineSettingError as e:
        return [str(e)], ""
    problems, what = _check_device(cfg)
    return problems, f"{what}; I/O engine {engine.describe()}" if what else what


def _check_device(cfg: Config) -> tuple[list[str], str]:
    from bladed.config import format_size, region_of, validate_device

    d = cfg.device
    path = cfg.device_path
    if d.backend == "file" and not os.path.exists(path):
        in_state = _inside(path, cfg.state_dir)
        problems = [] if in_state and not os.path.isdir(cfg.state_dir) else \
            _writable_dir("device.path", os.path.dirname(os.path.abspath(path)), may_create=in_state)
        if not d.size:
            problems.append(f"device.path: store file {path} does not exist and device.size is 0; set device.size "
                            "or create the file")
        lba = d.lba_size or 4096
        blocks = d.size // lba if d.size else 0
        if blocks:
            problems += validate_device(cfg, lba_size=lba, capacity_blocks=blocks, path=path)
        start, n = region_of(cfg, blocks) if blocks else (0, 0)
        return problems, (f"file {path} (created at start-up), {lba}-byte LBAs, region [{start}, {start + n}) = "
                          f"{format_size(n * lba)}")
    if d.backend != "file" and not os.path.exists(path):
        return [f"device.path: {path} does not exist (no such device); see `bladectl ns list`"], ""
    opts: dict[str, Any] = {}
    if d.backend == "file":
        opts = {"size_bytes": None, "lba_size": d.lba_size or 4096, "max_command_bytes": d.max_command_bytes,
                "create": False}
    elif d.backend == "block":
        opts = {"max_command_bytes": d.max_command_bytes}
    try:
        dev = open_device(d.backend, path, engine=cfg.io.engine, **opts)
    except EngineSettingError as e:
        return [str(e)], ""
    except PermissionError as e:
        return [f"device.path: no permission to open {path} read-write ({e.strerror}); run as a user in its group "
                "(udev/60-bladed.rules) or as root"], ""
    except (OSError, ValueError) as e:
        return [f"device.path: cannot use {path} as a {d.backend} device: {e}"], ""
    try:
        problems = validate_device(cfg, lba_size=dev.lba_size, capacity_blocks=dev.capacity_blocks, path=path)
        start, n = region_of(cfg, dev.capacity_blocks)
        what = f"{dev.kind} {dev.path}, {dev.lba_size}-byte LBAs, region [{start}, {start + n}) = " \
               f"{format_size(n * dev.lba_size)}"
    finally:
        with contextlib.suppress(OSError):
            dev.close()
    return problems, what


__all__ = ["check_device", "check_paths"]
