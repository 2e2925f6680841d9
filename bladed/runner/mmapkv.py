"""``--backend mmap``: the runner's KV in FlexLLMGen's disk offload (:mod:`bladed.torchdisk`), the yardstick.

Each KPU is a ``.npy`` memmap that the owner process's copy threads copy token ranges in and out of, the
kernel's page cache, readahead and writeback doing the rest, as FlexLLMGen's ``TorchDisk`` does. The owner
is a process of its own so that the page cache it touches can be held to a memory cgroup (``cgroup``)
apart from the runner's weights and activations, as bladed's daemon is (:mod:`bladed.torchdisk`).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from bladed.kvstore import Geometry, Kind, KVOp, full_precision_tail, stored_format
from bladed.spawn import cgroup_launcher
from bladed.torchdisk import OP_READ, OP_WRITE, TorchDiskClient

#: the ``path`` of this backend's op results (the runner's per-path statistics)
PATH = "mmap"


def start_owner(cgroup: str | None = None) -> TorchDiskClient:
    """Start a TorchDisk owner process (waiting for :class:`MmapKV` to open its store), in ``cgroup`` if given."""
    return TorchDiskClient(cgroup_launcher(cgroup) if cgroup else None)


class MmapKV:
    """A KV backend over FlexLLMGen's ``TorchDisk`` in an owner process (:class:`bladed.torchdisk.TorchDiskClient`).

    ``directory``: where the ``.npy`` files go (None: a temporary directory, removed at :meth:`close`; given,
    the files are removed and the directory kept). ``owner``: an owner process started earlier (its start-up
    is then not in the time to open this backend), else one is started here, joining the cgroup directory
    ``cgroup`` before it runs (its page cache is charged there: :func:`start_owner`). ``kv_tail``: as
    :class:`bladed.kvstore.MemoryKV`'s.
    """

    def __init__(self, geometry: Geometry, channels: int = 2, *, directory: str | None = None,
                 owner: TorchDiskClient | None = None, cgroup: str | None = None,
                 kv_tail: int | None = None) -> None:
        self.geometry = geometry
        self.kv_format = stored_format(geometry)
        #: the full-precision tail of the clients over this backend (:func:`bladed.kvstore.full_precision_tail`)
        self.kv_tail = full_precision_tail(self.kv_format, kv_tail)
        self._tmp = directory is None
        self.directory = tempfile.mkdtemp(prefix="bladed-torchdisk-") if directory is None else directory
        try:
            self.owner = (owner or start_owner(cgroup)).open(self.directory, geometry, channels)
        except BaseException:
            if self._tmp:
                shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._channels = channels
        self._closed = False

    @property
    def channels(self) -> int:
        return self._channels

    def slot(self, ch: int) -> memoryview:
        return self.owner.slot(ch)

    def group(self, layer: int, kind: Kind) -> int:
        return 1                          # one path: the page cache

    def write(self, layer: int, kind: Kind, ch: int, token_start: int = 0, ntokens: int | None = None) -> KVOp:
        n = self.geometry.max_tokens - token_start if ntokens is None else ntokens
        nbytes, ns, _ = self.owner.io(OP_WRITE, layer, kind, ch, token_start, n)
        return KVOp(PATH, nbytes, ns, None)

    def read(self, layer: int, kind: Kind, ch: int, token_start: int = 0, ntokens: int | None = None) -> KVOp:
        n = self.geometry.max_tokens - token_start if ntokens is None else ntokens
        nbytes, ns, hit = self.owner.io(OP_READ, layer, kind, ch, token_start, n)
        return KVOp(PATH, nbytes, ns, hit)

    def owner_info(self) -> dict[str, Any]:
        """The owner process: its pid and what it made the disk do since it was ready (``/proc/<pid>/io``)."""
        return {"pid": self.owner.pid, "io": self.owner.io_counters(), "startup_s": round(self.owner.setup_s, 4)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.owner.close()            # the owner removes its .npy files
        finally:
            if self._tmp:
                shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["PATH", "MmapKV", "start_owner"]
