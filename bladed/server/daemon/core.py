"""The bladed daemon: the device, the region, the socket, the connections, signals and reporting.

Threads: the main thread accepts connections and handles signals; each
connection has a thread of its own (:mod:`bladed.server.wire.connection`): a control
connection serves JSON requests, a data connection the binary I/O of one
channel of a session, each request on that thread.  The page-cache budget is
read from the sessions wing's one sampler (:mod:`bladed.server.sessions.budget_reading`),
which the live re-planner schedules beside its demotion worker
(:mod:`bladed.server.sessions.replan`).

Signals: SIGTERM/SIGINT drain the requests in progress, TRIM every extent,
remove the page-cache files and exit 0; SIGHUP reloads what can be reloaded
(``access``, ``budget``, ``log``, ``io.max_channels`` ...).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import selectors
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from bladed import __version__
from bladed.config import Config, ConfigError, format_size, group_id, load_config, region_of, reload_changes
from bladed.io import Engine, ExtentDevice
from bladed.protocol import PROTOCOL_VERSION, ErrorCode, RequestError
from bladed.residency.extents import ExtentAllocator
from bladed.server.blocks.pool import is_pool_record
from bladed.server.blocks.store import BlockStore
from bladed.server.daemon.exporter import Collector, MetricsServer
from bladed.server.daemon.lifecycle import open_store_device, reclaim
from bladed.server.daemon.preflight import check_paths
from bladed.server.daemon.systemd import sd_notify, setup_logging
from bladed.server.daemon.wear_watch import WearWatch
from bladed.server.events import Peer, event
from bladed.server.metrics import Stats
from bladed.server.sessions.budget_reading import REQUEST_MAX_AGE_S
from bladed.server.sessions.manager import SessionManager
from bladed.server.storage.journal import Journal
from bladed.server.storage.pagecache_store import sweep_pagecache
from bladed.server.wire.connection import Connection, refuse

log = logging.getLogger("bladed")


@contextlib.contextmanager
def _naming(key: str, path: str) -> Iterator[None]:
    """Turn an OSError of a start-up step into a ConfigError that names the key and the path."""
    try:
        yield
    except OSError as e:
        raise ConfigError([f"{key}: {path}: {e.strerror or e}; fix its permissions or choose another {key}"]) \
            from None


class Daemon:
    """Owns the device, the region, the page-cache directory and the socket."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.stopping = threading.Event()
        self.started = time.time()
        self.journal = Journal(cfg.state_dir)
        self.device: ExtentDevice
        self.allocator: ExtentAllocator
        self.manager: SessionManager
        self.blocks: BlockStore
        self.wear: WearWatch
        self.listener: socket.socket | None = None
        self.metrics: MetricsServer | None = None
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._signals: list[int] = []

    # -- start-up -----------------------------------------------------------------------
    def start(self) -> None:
        """Take the state directory, open the device, reclaim, listen (ConfigError naming the key on failure)."""
        cfg = self.cfg
        sd_notify("STATUS=starting")
        # the same checks as --check-config, before anything is created, bound or preallocated (a second
        # daemon on this state directory hears about the first one's lock, not its socket)
        problems = check_paths(cfg, live_socket=False)
        if problems:
            raise ConfigError(problems, cfg.source)
        with _naming("daemon.state_dir", cfg.state_dir):
            self.journal.acquire()
        try:
            self.device = open_store_device(cfg)
            start, blocks = region_of(cfg, self.device.capacity_blocks)
            self.allocator = ExtentAllocator(start, blocks, lba_size=self.device.lba_size)
            with _naming("daemon.pagecache_dir", cfg.pagecache_dir):
                os.makedirs(cfg.pagecache_dir, mode=0o750, exist_ok=True)
            kept = reclaim(cfg, self.device, self.allocator, self.journal, self.stats)
            # what bladed writes, today and since install, and the drive's own figures (docs/operations.md, "Wear")
            self.wear = WearWatch(cfg, self.device, self.stats)
            self.manager = SessionManager(cfg, self.device, self.allocator, self.journal, self.stats,
                                          self.wear.ledger)
            # retained prefixes of the last run: served only if every checksum verifies (bladed.server.prefixes.cache)
            self.manager.prefixes.restore([r for r in kept if not is_pool_record(r)])
            # block pools of the last run, with their committed blocks (bladed.server.blocks)
            self.blocks = BlockStore(cfg, self.device, self.allocator, self.journal, self.stats, self.manager)
            self.blocks.restore([r for r in kept if is_pool_record(r)])
            with _naming("socket.path", cfg.socket_path):
                self._listen()
            if cfg.metrics.enabled:
                with _naming("metrics.listen", cfg.metrics.listen):
                    self.metrics = MetricsServer(cfg.metrics_target, Collector(self.stats, self.gauges),
                                                 cfg.socket.mode)
        except BaseException:
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            self.journal.release()
            raise
        # keep re-sampling B_pc and demote live sessions' KPUs when it shrinks (bladed.server.sessions.replan)
        self.manager.replanner.start()
        self.wear.start()
        desc = self.device.describe()
        engine = self.device.engine_choice
        # once, with the reason: an operator reading why a box runs without io_uring finds it here
        log.log(logging.WARNING if engine.engine != "uring" and cfg.io.engine == "auto" else logging.INFO,
                "I/O engine: %s", engine.describe())
        self._log_group1_backing()
        event("daemon_start", version=__version__, pid=os.getpid(), backend=desc["kind"], device=desc["path"],
              engine=engine.engine, lba_size=desc["lba_size"], region=f"{start}+{blocks}", socket=cfg.socket_path,
              pagecache=cfg.pagecache_dir, group1_backing=cfg.group1_backing,
              metrics=self.metrics.address if self.metrics else "off", config=cfg.source or "embedded-default")
        sd_notify("READY=1", f"STATUS=serving on {cfg.socket_path}: {desc['kind']} {desc['path']}, "
                             f"region {format_size(blocks * self.device.lba_size)}", f"MAINPID={os.getpid()}")

    def _log_group1_backing(self) -> None:
        """Once, where ``pagecache.backing = "auto"`` did not give memory files: an operator upgrading with
        ``budget.live_replan = false`` finds why Dual-Blade's Group 1 is on disk."""
        cfg = self.cfg
        if cfg.pagecache.backing == "auto" and cfg.group1_backing == "disk":
            log.info("pagecache.backing = \"auto\": Dual-Blade's Group 1 in page-cache files on disk, since "
                     "budget.live_replan = false turns off live demotion, the one eviction of memory files")

    def _listen(self) -> None:
        cfg = self.cfg
        path = cfg.socket_path
        # only a socket inside the state directory gets its directory made (check_paths refused anything else)
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left by a crashed instance (we hold the state lock)
            else:
                raise ConfigError([f"socket.path: another process is serving {path}"], cfg.source)
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # no window in which the socket is more open than configured
        try:
            s.bind(path)
        finally:
            os.umask(old)
        gid = group_id(cfg.socket.group) if cfg.socket.group else -1
        if gid >= 0:
            os.chown(path, -1, gid)
        os.chmod(path, cfg.socket.mode)
        s.listen(64)
        s.setblocking(False)
        self.listener = s

    # -- the main loop ------------------------------------------------------------------------
    def install_signals(self) -> None:
        """Catch SIGTERM/SIGINT/SIGHUP from now on (handled by the main loop)."""
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def serve_forever(self) -> None:
        assert self.listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self.stopping.is_set():
                for key, _ in sel.select(1.0):
                    if key.data == "accept":
                        self._accept()
                    else:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(512)
                self._dispatch_signals()
        finally:
            sel.close()
            signal.set_wakeup_fd(-1)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _dispatch_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if sig == signal.SIGHUP:
                try:
                    self.reload()
                except Exception:  # a reload must never take the daemon down
                    log.exception("SIGHUP: reload failed; keeping the running configuration")
            else:
                log.info("%s received: draining and stopping", signal.Signals(sig).name)
                self.stopping.set()

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            sock.setblocking(True)
            try:
                self._admit(sock)
            except Exception:
                log.exception("admitting a connection failed")
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        peer = Peer.of(sock)
        refusal = self._refusal(peer)
        if refusal is not None:
            reason, code, why = refusal
            self.stats.count("connections_refused", reason)
            event("connection_refused", uid=peer.uid, gid=peer.gid, pid=peer.pid, reason=reason, error=why)
            threading.Thread(target=refuse, args=(sock, code, why), name="bladed-refuse", daemon=True).start()
            return
        # replies to a client that stops reading must not block its channel workers forever
        secs = int(self.cfg.io.send_timeout_s)
        usecs = int((self.cfg.io.send_timeout_s - secs) * 1e6)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", secs, usecs))
        conn = Connection(self, sock, peer)
        with self._conns_lock:
            self._conns.add(conn)
        conn.thread.start()

    def _refusal(self, peer: Peer) -> tuple[str, ErrorCode, str] | None:
        """None, or why ``peer`` is refused: (one of metrics.REFUSALS, the error code, the message)."""
        if not self.is_allowed(peer):
            return ("not_allowed", ErrorCode.PERMISSION_DENIED,
                    f"uid {peer.uid} (gid {peer.gid}) is not allowed to use bladed "
                    "(access.allowed_uids / access.allowed_gids)")
        with self._conns_lock:
            if len(self._conns) >= self.cfg.socket.max_connections:
                return ("too_many", ErrorCode.BUSY,
                        f"too many connections ({self.cfg.socket.max_connections}, socket.max_connections)")
        return None

    def is_allowed(self, peer: Peer) -> bool:
        a = self.cfg.access
        if peer.is_self or peer.uid in a.allowed_uids:
            return True
        if not a.allowed_gids:
            return False
        return peer.gid in a.allowed_gids or bool(peer.groups() & set(a.allowed_gids))

    def is_admin(self, peer: Peer) -> bool:
        return peer.is_self or peer.uid in self.cfg.access.admin_uids

    def forget(self, conn: Connection) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    # -- reporting -------------------------------------------------------------------------------
    def gauges(self) -> dict[str, Any]:
        """The live values of ``stats`` and of the Prometheus gauges (metrics.Collector)."""
        b = self.manager.budget.report()
        budget = {k: v for k, v in b.items()
                  if k in ("host_available_bytes", "memory_limit_bytes", "anon_shmem_bytes", "usable_bytes",
                           "pagecache_budget_bytes", "pagecache_budget_computed_bytes", "file_bytes",
                           "host_total_bytes", "pinned_bytes", "charged_kernel_bytes", "free_bytes",
                           "binding_cgroup", "memory_limit_source")}
        with self._conns_lock:
            connections = len(self._conns)
        formats = collections.Counter(s.geometry.kv_format or "plain" for s in self.manager.live_sessions())
        return {"sessions": len(self.manager.sessions), "sessions_by_kv_format": dict(formats),
                "connections": connections, "engine": self.device.engine,
                "extents": {"used_blocks": self.allocator.used_blocks, "free_blocks": self.allocator.free_blocks,
                            "largest_free": self.allocator.largest_free, "region_blocks": self.allocator.nblocks},
                "lba_size": self.device.lba_size,
                "budget": budget | {"held_bytes": self.manager.ledger.held_bytes},
                "replan": self.manager.replanner.to_dict(),
                "prefixes": self.manager.prefixes.gauges(),
                "wear": self.wear.gauges()}

    def wear_report(self) -> dict[str, Any]:
        """The ``wear`` op: bladed's writes today and since install, the write budget, the drive's figures."""
        return self.wear.report()

    def budget(self) -> dict[str, Any]:
        """The ``budget`` op: a reading measured for it (``REQUEST_MAX_AGE_S``), the ledger and each session's."""
        sample = self.manager.budget.report(REQUEST_MAX_AGE_S)
        held = self.manager.ledger.held_bytes
        live = self.manager.live_sessions()
        return {
            "sample": sample,
            "held_bytes": held,
            "available_bytes": max(0, int(sample.get("pagecache_budget_bytes", 0)) - held),
            "override_bytes": self.cfg.budget.override,
            "cap_bytes": self.cfg.budget.cap,
            "sessions": [{"session": s.id, "channels": len(s.channels), "pinned_per_thread_bytes": s.slot_stride,
                          "budget_bytes": s.plan.budget_bytes, "group1_limit_bytes": s.plan.group1_limit_bytes,
                          "group1_layers": s.plan.group1_layers, "group1_bytes": s.plan.group1_bytes,
                          "budget": s.budget} for s in live],
        }

    def status(self) -> dict[str, Any]:
        d = self.device
        b = self.manager.budget.report()
        return {
            "version": __version__, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
            "uptime_s": time.time() - self.started, "config": self.cfg.source or "embedded-default",
            "state_dir": self.cfg.state_dir, "socket": self.cfg.socket_path, "pagecache_dir": self.cfg.pagecache_dir,
            "device": d.describe(),
            "engine": {"engine": d.engine, "reason": d.engine_choice.reason},
            "region": {"start_lba": self.allocator.start_lba, "blocks": self.allocator.nblocks,
                       "bytes": self.allocator.nblocks * d.lba_size},
            "extents": {"used_blocks": self.allocator.used_blocks, "free_blocks": self.allocator.free_blocks},
            "sessions": len(self.manager.sessions), "connections": len(self._conns),
            "metrics": self.metrics.address if self.metrics else None,
            "budget": {k: b.get(k) for k in ("pagecache_budget_bytes", "usable_bytes", "cgroup", "cgroup_version")},
        }

    def trim_region(self) -> dict[str, Any]:
        """Deallocate the whole region; refused while any session is open."""
        if self.manager.sessions:
            raise RequestError(ErrorCode.BUSY, f"{len(self.manager.sessions)} session(s) open; "
                                               "trim reclaims the region only when none is")
        if self.blocks.pools:
            raise RequestError(ErrorCode.BUSY, f"{len(self.blocks.pools)} block pool(s) hold blocks on the region; "
                                               "drop them first (blocks drop_pool)")
        a = self.allocator
        t0 = time.perf_counter()
        with Engine(self.device, 4) as eng:
            eng.discard(a.start_lba, a.nblocks)
        nbytes = a.nblocks * self.device.lba_size
        removed = sweep_pagecache(self.cfg.pagecache_dir)
        self.stats.add("trimmed_bytes", nbytes)
        event("trim", region=f"{a.start_lba}+{a.nblocks}", trimmed_bytes=nbytes, pagecache_dirs_removed=removed)
        return {"trimmed_bytes": nbytes, "start_lba": a.start_lba, "blocks": a.nblocks,
                "seconds": time.perf_counter() - t0, "pagecache_dirs_removed": removed}

    # -- reload and stop ----------------------------------------------------------------------------
    def reload(self) -> None:
        """SIGHUP: re-read the configuration file and apply the keys that can change live."""
        sd_notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            if not self.cfg.source:
                log.info("SIGHUP: running on the embedded default configuration; nothing to reload")
                return
            try:
                new = load_config(self.cfg.source, state_dir=self.cfg.daemon.state_dir)
            except ConfigError as e:
                log.error("SIGHUP: keeping the running configuration: %s", e)
                return
            applied, restart = reload_changes(self.cfg, new)
            for name in applied:
                section, key = name.split(".", 1)
                setattr(getattr(self.cfg, section), key, getattr(getattr(new, section), key))
            if "log.level" in applied or "log.format" in applied:
                setup_logging(self.cfg)
            if any(name.startswith("budget.") for name in applied):
                self.manager.replanner.restart()   # new override/cap/cgroup: re-sample and apply now
            if "budget.live_replan" in applied:
                self._log_group1_backing()
                held = self.manager.own_kv_memory_bytes()
                if held and not self.cfg.budget.live_replan:
                    log.warning("SIGHUP: budget.live_replan = false: %s of Group 1 in memory files stay in memory, "
                                "evicted by nothing, until their sessions close", format_size(held))
            event("reload", applied=",".join(applied) or "none", needs_restart=",".join(restart) or "none")
        finally:
            sd_notify("READY=1", f"STATUS=serving on {self.cfg.socket_path} (reloaded)")

    def stop(self) -> None:
        """Graceful drain: refuse new work, finish in-flight requests, TRIM, remove files, exit."""
        self.stopping.set()
        sd_notify("STOPPING=1", "STATUS=draining sessions")
        if self.listener is not None:
            self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.socket_path)
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            c.shutdown_read()
        for c in conns:
            c.thread.join()
        self.manager.replanner.stop()
        self.manager.close_all("shutdown")
        self.blocks.shutdown()    # block pools stay on storage, and in the journal, for the next start
        self.wear.stop()       # the ledger's last write, with the sessions' counts in
        # retained prefixes stay on storage, and in the journal, for the next start
        self.manager.prefixes.close()
        if self.metrics is not None:
            self.metrics.close()
        event("daemon_stop", trimmed_bytes=self.stats.trimmed_bytes, sessions_closed=self.stats.sessions_closed)
        # every closed session left the journal; what is still there (quarantined blocks, a session
        # whose teardown failed) the next start-up scrubs again
        self.device.close()
        self.journal.release()


__all__ = ["Daemon"]
