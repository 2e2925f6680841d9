"""FlexLLMGen's disk offload of the KV cache (``TorchDisk``), as FlexLLMGen does it: the yardstick.

What vanilla FlexLLMGen does with an offloaded KV cache, reproduced here:

* at start, one ``.npy`` file per KPU created with
  ``np.lib.format.open_memmap(path, mode="w+", shape=(max_tokens, B*H, D), dtype=...)``
  (a sparse file behind a 128-byte npy header);
* every copy re-opens the tensor with ``np.lib.format.open_memmap(path)``,
  slices the token range and copies it between the mapping and the copy
  thread's pinned relay buffer (``map_to_torch_tensor`` + ``copy_`` in
  FlexLLMGen's ``copy_worker_func``); the mapping is dropped afterwards;
* no ``madvise``, no ``fadvise``, no flushes: the kernel's page cache,
  readahead and writeback do everything.

The copy threads run in a process of their own (``python -m bladed.torchdisk``, the *owner*), not in
the inference process as in FlexLLMGen, for one reason: a memory cgroup charges a page to the
process that faults it in, per process and not per thread, so the page cache of the ``.npy`` files
can be held to a memory limit apart from the model's weights and activations only if another
process touches it. That is how bladed's daemon owns its page cache too, so both sides are limited
alike (``tools/bench_e2e.py``, the benchmark harness's Baseline). The relay buffers are shared memfd
slots, one KPU per copy thread, mapped by both processes (bladed's staging slots are the same);
each copy thread serves one channel over a socketpair. The copy is ``numpy.copyto`` (FlexLLMGen calls
``torch.Tensor.copy_``: the same memcpy between the same mappings); torch is not imported in the
owner, so that its libraries do not eat into the memory limit.

Hit ratio of a read: the share of its bytes the kernel did not read from the disk while the copy
thread faulted them in (``/proc/thread-self/io`` ``read_bytes``, readahead included; FlexLLMGen has
no such measure). The owner's whole-run disk traffic is :meth:`TorchDiskClient.io_counters`.

A leaf beside bladed's client and server: numpy and the standard library, no torch, no ``bladed.io``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
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
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bladed.kvformat import kv_format
from bladed.residency.geometry import Geometry
from bladed.sizes import PAGE_SIZE, align_up

REQ = struct.Struct("<BiBii")           # op (1 read, 2 write, 0 quit), layer, kind (0 k, 1 v), token_start, ntokens
REP = struct.Struct("<qqdi")            # nbytes, service_ns, hit_ratio (-1: unknown), errno (0 ok)
OP_QUIT, OP_READ, OP_WRITE = 0, 1, 2
READY = b"R"
#: the counters of ``/proc/<pid>/io`` that :meth:`TorchDiskClient.io_counters` reports
IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes", "cancelled_write_bytes")


def read_proc_io(pid: int | str = "self") -> dict[str, int] | None:
    """``/proc/<pid>/io`` as numbers (``thread-self`` for the calling thread); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/io") as f:
            text = f.read()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        with contextlib.suppress(ValueError):
            out[key.strip()] = int(value)
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def npy_layout(geometry: Geometry) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype of one KPU's ``.npy`` file: ``(max_tokens, B*H, D)`` of the rows' elements, or for a
    quantized format ``(max_tokens, token_bytes)`` bytes (its rows, one per token)."""
    g = geometry
    if g.kv_format and not kv_format(g.kv_format).plain:
        return (g.max_tokens, g.token_bytes), np.uint8
    dtype = {2: np.float16, 4: np.float32, 1: np.uint8, 8: np.float64}[g.dtype_bytes]
    return (g.max_tokens, g.batch * g.kv_heads, g.head_dim), dtype


def npy_paths(directory: str, layers: int) -> dict[tuple[int, int], str]:
    """The ``.npy`` file of each KPU, keyed by (layer, kind: 0 K, 1 V)."""
    return {(layer, kind): os.path.join(directory, f"t_{layer}_{'kv'[kind]}.npy")
            for layer in range(layers) for kind in (0, 1)}


def remove_npy_files(directory: str, layers: int) -> None:
    """Remove the KPU files an owner made in ``directory`` (none left behind when it did not exit cleanly)."""
    for p in npy_paths(directory, layers).values():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


# -- the owner: copy threads over mmap'd .npy files ----------------------------------------

class TorchDiskStore:
    """2L memmap'd ``.npy`` files and the copies between them and the relay buffers."""

    def __init__(self, directory: str, geometry: Geometry) -> None:
        self.dir = directory
        self.geometry = geometry
        self.token_bytes = geometry.token_bytes
        self.shape, self.dtype = npy_layout(geometry)
        os.makedirs(directory, exist_ok=True)
        self.paths = npy_paths(directory, geometry.layers)
        self.header = 0
        for path in self.paths.values():
            # TorchDisk.allocate: np.lib.format.open_memmap(path, mode="w+", shape=shape, dtype=dtype)
            mm = np.lib.format.open_memmap(path, mode="w+", shape=self.shape, dtype=self.dtype)
            self.header = int(mm.offset)
            del mm

    def copy(self, op: int, layer: int, kind: int, t0: int, n: int, relay: np.ndarray) -> tuple[int, int, float]:
        """Copy tokens ``[t0, t0 + n)`` between the KPU's file and ``relay``: (bytes, ns, hit ratio or -1)."""
        if not (0 <= layer < self.geometry.layers and kind in (0, 1) and 0 <= t0 <= t0 + n <= self.geometry.max_tokens):
            raise OSError(errno.EINVAL, f"no tokens [{t0}, {t0 + n}) of KPU ({layer}, {kind})")
        t = time.perf_counter_ns()
        hit = -1.0
        # map_to_torch_tensor(): torch.from_numpy(np.lib.format.open_memmap(tensor.data))[indices]
        data = np.lib.format.open_memmap(self.paths[(layer, kind)])
        if op == OP_READ:
            before = read_proc_io("thread-self")
            np.copyto(relay[t0:t0 + n], data[t0:t0 + n])
            after = read_proc_io("thread-self")
            nbytes = n * self.token_bytes
            if before is not None and after is not None and nbytes:
                from_disk = after.get("read_bytes", 0) - before.get("read_bytes", 0)
                hit = max(0.0, 1.0 - from_disk / nbytes)
        else:
            np.copyto(data[t0:t0 + n], relay[t0:t0 + n])
        del data
        return n * self.token_bytes, time.perf_counter_ns() - t, hit

    def close(self) -> None:
        remove_npy_files(self.dir, self.geometry.layers)


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


def _open_store(control: socket.socket) -> tuple[TorchDiskStore, list[socket.socket], list[np.ndarray], mmap.mmap]:
    """Receive the store's parameters and descriptors (memfd, one socket per copy thread) and set it up."""
    msg, fds, _flags, _addr = socket.recv_fds(control, 1 << 16, 64)
    if not msg:
        raise ConnectionError("the inference process closed the control socket before opening a store")
    spec = json.loads(msg)
    memfd, channel_fds = fds[0], fds[1:]
    mapping = mmap.mmap(memfd, os.fstat(memfd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(memfd)
    store = TorchDiskStore(spec["dir"], Geometry.from_dict(spec["geometry"]))
    elems = math.prod(store.shape)
    socks = [socket.socket(fileno=fd) for fd in channel_fds]
    relays = [np.frombuffer(mapping, dtype=store.dtype, count=elems, offset=ch * spec["slot_stride"])
              .reshape(store.shape) for ch in range(len(socks))]
    # the copy threads' pinned relay buffers belong to the KV's owner (Eq. 2's N_threads * M_pin): touch them
    # here first so that they are charged to this process's cgroup, as bladed's staging is charged to the daemon
    for r in relays:
        r.fill(0)
    return store, socks, relays, mapping


def child_main(argv: list[str] | None = None) -> int:
    """The owner process (``python -m bladed.torchdisk --control-fd FD``), started by :class:`TorchDiskClient`:
    it waits on the control socket for one store to open, serves its copy threads, and exits when they quit."""
    ap = argparse.ArgumentParser(prog="python -m bladed.torchdisk")
    ap.add_argument("--control-fd", type=int, required=True, help="the control socket (a socketpair's end)")
    a = ap.parse_args(argv)
    control = socket.socket(fileno=a.control_fd)
    control.sendall(READY)                # started: the inference process may open a store now
    try:
        store, socks, relays, _mapping = _open_store(control)
    except ConnectionError:
        return 0
    threads = [threading.Thread(target=_serve_channel, args=(store, s, r), name=f"copy-{i}", daemon=True)
               for i, (s, r) in enumerate(zip(socks, relays, strict=True))]
    for t in threads:
        t.start()
    control.sendall(READY)                # the store is open
    for t in threads:
        t.join()
    store.close()
    return 0


# -- the inference process's side ------------------------------------------------------------

class TorchDiskError(RuntimeError):
    """The owner process could not start or open the store; the message is one line naming the cause."""


class TorchDiskClient:
    """The owner process (started at once, through ``launcher``, e.g. a memory cgroup's) and, once :meth:`open`
    made it, one store whose copy threads it talks to.

    Starting the owner apart from opening the store keeps the interpreter's start-up out of the run, as
    FlexLLMGen has no such process: a runner starts its owners before it loads the model. ``slot(ch)`` is copy
    thread ``ch``'s relay buffer (one KPU of the geometry's rows); :meth:`io` copies a token range between it
    and a KPU's file. ``env``: the owner's environment (default: this one).
    """

    def __init__(self, launcher: Callable[[list[str]], list[str]] | None = None, *,
                 env: Mapping[str, str] | None = None, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._control, child = socket.socketpair()
        argv = [sys.executable, "-m", "bladed.torchdisk", "--control-fd", str(child.fileno())]
        if launcher is not None:
            argv = launcher(argv)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                                     env=None if env is None else dict(env))
        child.close()
        self.geometry: Geometry | None = None
        self.directory = ""
        self.channels = 0
        self._socks: list[socket.socket] = []
        self._locks: list[threading.Lock] = []
        self._memfd = -1
        self._mapping: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.slot_stride = self.kpu_bytes = self.token_bytes = 0
        self.setup_s = 0.0
        self._io_ready: dict[str, int] | None = None
        self._io_end: dict[str, int] | None = None
        self._started = False

    def wait_started(self) -> TorchDiskClient:
        """Wait until the owner process has started (:meth:`open` does, if this was not called before)."""
        if not self._started:
            self._expect_ready("exited before it started")
            self._started = True
        return self

    def _expect_ready(self, what: str) -> None:
        self._control.settimeout(self.timeout)
        try:
            ready = _recv_exact(self._control, 1)
        except (ConnectionError, TimeoutError) as e:
            self.close()
            raise TorchDiskError(f"the TorchDisk owner process {what} (status {self.proc.returncode}: {e}); its "
                                 "error is on stderr") from None
        if ready != READY:
            self.close()
            raise TorchDiskError(f"unexpected reply from the TorchDisk owner process when it {what}")

    def open(self, directory: str, geometry: Geometry, channels: int = 2) -> TorchDiskClient:
        """Make the store: ``channels`` relay buffers and copy threads, one ``.npy`` file per KPU in ``directory``."""
        if self.geometry is not None:
            raise RuntimeError("this TorchDisk owner already has a store")
        self.wait_started()
        t0 = time.perf_counter()
        self.geometry, self.directory, self.channels = geometry, directory, channels
        self.token_bytes, self.kpu_bytes = geometry.token_bytes, geometry.kpu_bytes
        self.slot_stride = align_up(self.kpu_bytes, PAGE_SIZE)
        size = self.slot_stride * channels
        self._memfd = os.memfd_create("bladed-torchdisk-relay", os.MFD_CLOEXEC)
        os.ftruncate(self._memfd, size)
        self._mapping = mmap.mmap(self._memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._mapping)
        pairs = [socket.socketpair() for _ in range(channels)]
        self._socks = [p[0] for p in pairs]
        self._locks = [threading.Lock() for _ in range(channels)]
        spec = {"dir": directory, "geometry": geometry.to_dict(), "slot_stride": self.slot_stride}
        try:
            socket.send_fds(self._control, [json.dumps(spec).encode()], [self._memfd, *(p[1].fileno() for p in pairs)])
        except OSError as e:
            self.close()
            raise TorchDiskError(f"the TorchDisk owner process is gone ({e}); its error is on stderr") from None
        finally:
            for p in pairs:
                p[1].close()
        self._expect_ready("could not open the store in " + directory)
        self._control.settimeout(None)
        self.setup_s = time.perf_counter() - t0
        #: the owner's /proc io counters once the store is open (its start-up's reads are not the KV's)
        self._io_ready = read_proc_io(self.proc.pid)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def slot(self, ch: int) -> memoryview:
        assert self._view is not None, "open() the store first"
        return self._view[ch * self.slot_stride:ch * self.slot_stride + self.kpu_bytes]

    def io(self, op: int, layer: int, kind: str, ch: int, t0: int, n: int) -> tuple[int, int, float | None]:
        """Copy tokens ``[t0, t0 + n)`` of KPU (``layer``, ``kind``) between slot ``ch`` and its file
        (``OP_READ``: file to slot): (bytes, service ns, hit ratio or None)."""
        with self._locks[ch]:
            s = self._socks[ch]
            s.sendall(REQ.pack(op, layer, 0 if kind == "k" else 1, t0, n))
            nbytes, ns, hit, err = REP.unpack(_recv_exact(s, REP.size))
        if err:
            raise OSError(err, f"TorchDisk {'read' if op == OP_READ else 'write'} of tokens [{t0}, {t0 + n}) of "
                               f"({layer}, {kind}) failed: {os.strerror(err)}")
        return nbytes, ns, (hit if hit >= 0 else None)

    def io_counters(self) -> dict[str, int] | None:
        """The owner's ``/proc/<pid>/io`` counters (:data:`IO_FIELDS`) since the store was open: its KV traffic
        (``read_bytes`` / ``write_bytes``: what it made the disk do). Taken at :meth:`close` once closed."""
        now = self._io_end if self._io_end is not None else read_proc_io(self.proc.pid)
        if now is None or self._io_ready is None:
            return None
        return {k: now.get(k, 0) - self._io_ready.get(k, 0) for k in IO_FIELDS}

    def close(self) -> None:
        """Stop the copy threads and the owner (it removes its files); release the relay buffers."""
        if self.proc.poll() is None:
            self._io_end = read_proc_io(self.proc.pid)
        for s, lock in zip(self._socks, self._locks, strict=True):
            with lock, contextlib.suppress(OSError):
                s.sendall(REQ.pack(OP_QUIT, 0, 0, 0, 0))
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)   # an owner still waiting for a store exits
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.geometry is not None:    # an owner that did not exit cleanly left its files
            remove_npy_files(self.directory, self.geometry.layers)
        for s in (*self._socks, self._control):
            s.close()
        self._socks, self._locks = [], []
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mapping is not None:
            with contextlib.suppress(BufferError):
                self._mapping.close()
            self._mapping = None
        if self._memfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._memfd)
            self._memfd = -1


__all__ = ["IO_FIELDS", "OP_QUIT", "OP_READ", "OP_WRITE", "TorchDiskClient", "TorchDiskError", "TorchDiskStore",
           "child_main", "npy_layout", "npy_paths", "read_proc_io", "remove_npy_files"]


if __name__ == "__main__":
    sys.exit(child_main())
