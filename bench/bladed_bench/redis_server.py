"""A redis-server of one's own (the shared prefix tier's benchmark and tests): a free loopback port or a Unix
socket, persistence off, LRU eviction, up once it says it is ready."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading


class RedisServer:
    """``redis-server`` in ``directory``: on a Unix socket there (``unix=True``) or a free loopback TCP port."""

    def __init__(self, directory: str, *, unix: bool = False, maxmemory: str = "1gb") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server; tools/setup.sh does)")
        if unix:
            self.socket = os.path.join(directory, "redis.sock")
            where = ["--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700"]
            self.url = f"unix://{self.socket}"
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            where = ["--port", str(port), "--bind", "127.0.0.1"]
            self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen([binary, *where, "--save", "", "--appendonly", "no", "--dir", directory,
                                      "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "ready to accept connections" in line.lower():
                break
        else:
            raise RuntimeError(f"redis-server exited ({self.proc.wait()}) before it was ready")
        # keep reading its log, so that it never blocks on a full pipe
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


__all__ = ["RedisServer"]
