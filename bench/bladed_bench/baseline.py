"""The Baseline of Table III: a FlexLLMGen ``TorchDisk``-style mmap path.

What vanilla FlexLLMGen does with an offloaded KV cache, reproduced here:

* at start, one ``.npy`` file per KPU created with
  ``np.lib.format.open_memmap(path, mode="w+", shape=(max_tokens, B*H, D),
  dtype=float16)`` (a sparse file behind a 128-byte npy header);
* every copy re-opens the tensor with ``np.lib.format.open_memmap(path)``,
  slices the token range and copies it between the mapping and the copy
  thread's pinned relay buffer (``map_to_torch_tensor`` + ``copy_`` in
  FlexLLMGen's ``copy_worker_func``); the mapping is dropped afterwards;
* no ``madvise``, no ``fadvise``, no flushes: the kernel's page cache,
  readahead and writeback do everything.

The copy threads run in a child process (``python -m bladed_bench.baseline``)
that the sweep places in the memory cgroup under test, exactly as the daemon
is placed there in the bladed configurations: the page cache is charged to the
process that touches the mmap pages.  The relay buffers are the same shared
memfd slots a bladed session uses (one KPU per copy thread), so the driver,
its modelled DMA and the per-op accounting are identical for every
configuration.  Each copy thread serves one channel over a socketpair.

The copy is ``numpy.copyto`` (FlexLLMGen calls ``torch.Tensor.copy_``: the
same memcpy between the same mappings); torch is not imported in the child
so that its libraries do not eat into the memory limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from bladed.kvformat import kv_format
from bladed.residency.geometry import Geometry
from bladed.sizes import align_up
from bladed_bench.repo import repo_env

REQ = struct.Struct("<BiBii")           # op (1 read, 2 write, 0 quit), layer, kind (0 k, 1 v), token_start, ntokens
REP = struct.Struct("<qqdi")            # nbytes, service_ns, hit_ratio (-1: unknown), errno (0 ok)
OP_QUIT, OP_READ, OP_WRITE = 0, 1, 2
READY = b"R"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


# -- the child: copy threads over mmap'd .npy files ----------------------------------------

class TorchDiskStore:
    """2L memmap'd ``.npy`` files and the copies between them and the relay buffers."""

    def __init__(self, directory: str, geometry: dict[str, Any]) -> None:
        from bladed.io.pagecache import cachestat

        self._cachestat = cachestat
        self.dir = directory
        self.g = geometry
        shape = Geometry.from_dict(geometry)
        self.token_bytes = shape.token_bytes
        if shape.kv_format and not kv_format(shape.kv_format).plain:
            # a quantized format: FlexLLMGen's files hold its rows of bytes, one per token
            self.shape: tuple[int, ...] = (shape.max_tokens, shape.token_bytes)
            self.dtype: Any = np.uint8
        else:
            self.shape = (shape.max_tokens, shape.batch * shape.kv_heads, shape.head_dim)
            self.dtype = {2: np.float16, 4: np.float32, 1: np.uint8, 8: np.float64}[shape.dtype_bytes]
        os.makedirs(directory, exist_ok=True)
        self.paths: dict[tuple[int, int], str] = {}
        self.fds: dict[tuple[int, int], int] = {}
        self.header = 0
        for layer in range(geometry["layers"]):
            for kind in (0, 1):
                path = os.path.join(directory, f"t_{layer}_{'kv'[kind]}.npy")
                # TorchDisk.allocate: np.lib.format.open_memmap(path, mode="w+", shape=shape, dtype=dtype)
                mm = np.lib.format.open_memmap(path, mode="w+", shape=self.shape, dtype=self.dtype)
                self.header = int(mm.offset)
                del mm
                self.paths[(layer, kind)] = path
                # only for cachestat(2) (the hit ratio); the copies never use it
                self.fds[(layer, kind)] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def copy(self, op: int, layer: int, kind: int, t0: int, n: int, relay: np.ndarray) -> tuple[int, int, float]:
        key = (layer, kind)
        t = time.perf_counter_ns()
        hit = -1.0
        # map_to_torch_tensor(): torch.from_numpy(np.lib.format.open_memmap(tensor.data))[indices]
        data = np.lib.format.open_memmap(self.paths[key])
        if op == OP_READ:
            cs = self._cachestat(self.fds[key], self.header + t0 * self.token_bytes, n * self.token_bytes)
            if cs is not None:
                first = (self.header + t0 * self.token_bytes) // mmap.PAGESIZE
                last = (self.header + (t0 + n) * self.token_bytes - 1) // mmap.PAGESIZE
                hit = min(cs.cache, last - first + 1) / (last - first + 1)
            np.copyto(relay[t0:t0 + n], data[t0:t0 + n])
        else:
            np.copyto(data[t0:t0 + n], relay[t0:t0 + n])
        del data
        return n * self.token_bytes, time.perf_counter_ns() - t, hit

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        for p in self.paths.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def _serve_channel(store: TorchDiskStore, sock: socket.socket, relay: np.ndarray) -> None:
    while True:
        try:
            op, layer, kind, t0, n = REQ.unpack(_recv_exact(sock, REQ.size))
        except ConnectionError:
            return
        if op == OP_QUIT:
            return
        try:
            nbytes, ns, hit = store.copy(op, layer, kind, t0, n, relay)
            sock.sendall(REP.pack(nbytes, ns, hit, 0))
        except OSError as e:
            sock.sendall(REP.pack(0, 0, -1.0, e.errno or 5))


def child_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bladed_bench.baseline")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--geometry", required=True, help="JSON geometry")
    ap.add_argument("--memfd", type=int, required=True)
    ap.add_argument("--slot-stride", type=int, required=True)
    ap.add_argument("--channel-fds", required=True, help="comma-separated socket fds, one per copy thread")
    a = ap.parse_args(argv)
    g = json.loads(a.geometry)
    fds = [int(x) for x in a.channel_fds.split(",")]
    size = os.fstat(a.memfd).st_size
    mapping = mmap.mmap(a.memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    store = TorchDiskStore(a.dir, g)
    shape = store.shape
    elems = math.prod(shape)
    socks = [socket.socket(fileno=fd) for fd in fds]
    relays = [np.frombuffer(mapping, dtype=store.dtype, count=elems, offset=ch * a.slot_stride).reshape(shape)
              for ch in range(len(socks))]
    # the copy threads' pinned relay buffers belong to the inference process under the limit (Eq. 2's
    # N_threads * M_pin): touch them here first so they are charged to this cgroup, as bladed's staging
    # is charged to the daemon's when it registers it with io_uring
    for r in relays:
        r.fill(0)
    threads = [threading.Thread(target=_serve_channel, args=(store, s, r), name=f"copy-{i}", daemon=True)
               for i, (s, r) in enumerate(zip(socks, relays, strict=True))]
    for t in threads:
        t.start()
    socks[0].sendall(READY)
    for t in threads:
        t.join()
    store.close()
    del relays
    return 0


# -- the driver side ----------------------------------------------------------------------

class TorchDiskClient:
    """Starts the child (optionally through a cgroup launcher) and talks to its copy threads."""

    def __init__(self, directory: str, geometry: dict[str, Any], channels: int = 2,
                 launcher: Any = None, align: int = 4096) -> None:
        self.geometry = geometry
        self.channels = channels
        g = Geometry.from_dict(geometry)
        self.token_bytes = g.token_bytes
        self.kpu_bytes = g.kpu_bytes
        self.slot_stride = align_up(self.kpu_bytes, align)
        size = self.slot_stride * channels
        self._memfd = os.memfd_create("bladed-bench-relay", os.MFD_CLOEXEC)
        os.ftruncate(self._memfd, size)
        self._mapping = mmap.mmap(self._memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._mapping)
        pairs = [socket.socketpair() for _ in range(channels)]
        self._socks = [p[0] for p in pairs]
        child_fds = [p[1].fileno() for p in pairs]
        self._locks = [threading.Lock() for _ in range(channels)]
        argv = [sys.executable, "-m", "bladed_bench.baseline", "--dir", directory, "--geometry",
                json.dumps(geometry), "--memfd", str(self._memfd), "--slot-stride", str(self.slot_stride),
                "--channel-fds", ",".join(map(str, child_fds))]
        if launcher is not None:
            argv = launcher(argv)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, pass_fds=(self._memfd, *child_fds), env=repo_env(),
                                     stdin=subprocess.DEVNULL)
        for p in pairs:
            p[1].close()
        self._socks[0].settimeout(600)
        try:
            ready = _recv_exact(self._socks[0], 1)
        except (ConnectionError, TimeoutError) as e:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the TorchDisk child exited before it was ready ({self.proc.returncode}): {e}")\
                from None
        self._socks[0].settimeout(None)
        if ready != READY:
            raise RuntimeError("unexpected greeting from the TorchDisk child")
        self.setup_s = time.perf_counter() - t0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def slot(self, ch: int) -> memoryview:
        return self._view[ch * self.slot_stride:ch * self.slot_stride + self.kpu_bytes]

    def io(self, op: int, layer: int, kind: str, ch: int, t0: int, n: int) -> tuple[int, int, float | None]:
        with self._locks[ch]:
            s = self._socks[ch]
            s.sendall(REQ.pack(op, layer, 0 if kind == "k" else 1, t0, n))
            nbytes, ns, hit, err = REP.unpack(_recv_exact(s, REP.size))
        if err:
            raise OSError(err, f"TorchDisk {'read' if op == OP_READ else 'write'} of ({layer}, {kind}) failed")
        return nbytes, ns, (hit if hit >= 0 else None)

    def close(self) -> None:
        for s, lock in zip(self._socks, self._locks, strict=True):
            with lock, contextlib.suppress(OSError):
                s.sendall(REQ.pack(OP_QUIT, 0, 0, 0, 0))
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for s in self._socks:
            s.close()
        self._view.release()
        with contextlib.suppress(BufferError):
            self._mapping.close()
        os.close(self._memfd)


if __name__ == "__main__":
    sys.exit(child_main())
