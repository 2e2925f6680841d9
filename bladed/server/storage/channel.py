"""One channel of a session: an io_uring (``Engine``) and one staging slot, used by one thread at a time.

A client copy thread drives one channel over its own data connection, and
the daemon serves that connection's requests on the connection's thread: the
request runs where it arrives, with no queue or worker in between.  Requests
on different channels run in parallel threads (cffi drops the GIL inside the
engine), so two copy threads overlap their storage I/O (overlap-intra,
paper §IV-C).  The lock only matters when something else borrows the channel
(a JSON ``read``/``write`` on the control connection, a live demotion, the
session's teardown waiting for the request in flight).  It is a C mutex
(``bd_chan``), because the lane's C loop takes it too
(``bladed.server.wire.lane``); the channel's counters live beside it.

Each channel's ring reads through a window (``io.read_window_bytes``,
default :data:`READ_WINDOW_BYTES`), so that small writes of other channels
pass its bulk reads at the device.
"""

from __future__ import annotations

import ctypes
from typing import Any

from bladed import _uring
from bladed._uring import ffi, lib
from bladed.io import Engine, StagingBuffer

#: reads in flight on one channel's ring, in pieces of half of it: a one-token append on another channel waits
#: behind at most this much of this channel's reads (the device serves its queue in order), not behind a whole
#: multi-MiB read (docs/engine.md, "Read window")
READ_WINDOW_BYTES = 1 << 20


class Channel:
    """A ring bound to the session's device and one slot of the client's staging memory."""

    def __init__(self, index: int, engine: Engine, slot: StagingBuffer, read_window: int = READ_WINDOW_BYTES) -> None:
        self.index = index
        self.engine = engine
        engine.ring.read_window = read_window
        self.slot = slot
        self.chan = ffi.gc(lib.bd_chan_new(), lib.bd_chan_free)
        if self.chan == ffi.NULL:
            raise MemoryError("no memory for a channel")
        self.lock = ChannelLock(self.chan)
        #: what the lane served on this channel (Stats folds in its io counters), and both paths' ops/busy time
        self.counters = lib.bd_chan_counters(self.chan)

    @property
    def ops(self) -> int:
        """Ranges run on this channel."""
        return int(self.counters.channel_ops)

    @property
    def busy_ns(self) -> int:
        """Time spent running them."""
        return int(self.counters.busy_ns)

    @property
    def lane_requests(self) -> int:
        """Requests the lane served on this channel (without Python)."""
        return int(self.counters.requests)

    def account(self, busy_ns: int, ops: int) -> None:
        """Count ranges the general path ran (the caller holds :attr:`lock`)."""
        c = self.counters
        c.busy_ns += busy_ns
        c.channel_ops += ops

    def close(self) -> None:
        """Close the ring and let go of the slot (the caller holds :attr:`lock`)."""
        self.engine.close()
        self.slot.close()


# cffi lets go of the GIL around every call, and a thread that lets go of it waits to get it back behind any
# other thread that wanted it meanwhile.  Taking a free mutex and letting go of one takes nanoseconds, so those
# two calls go through ctypes.PyDLL, which keeps the GIL; only a wait for a held channel lets go of it.
_KEEP_GIL = ctypes.PyDLL(_uring.__file__)
_trylock = _KEEP_GIL.bd_chan_trylock
_trylock.argtypes = [ctypes.c_void_p]
_trylock.restype = ctypes.c_int
_unlock = _KEEP_GIL.bd_chan_unlock
_unlock.argtypes = [ctypes.c_void_p]
_unlock.restype = None


class ChannelLock:
    """A channel's lock: the C mutex the lane takes around each request it serves.

    ``threading.Lock``'s face (acquire, release, a context manager); waiting happens with the GIL released.
    Released by the thread that acquired it.
    """

    __slots__ = ("_address", "_chan")

    def __init__(self, chan: Any) -> None:
        self._chan = chan
        self._address = int(ffi.cast("uintptr_t", chan))

    def acquire(self, blocking: bool = True) -> bool:
        if _trylock(self._address) == 0:
            return True
        if blocking:
            lib.bd_chan_lock(self._chan)
            return True
        return False

    def release(self) -> None:
        _unlock(self._address)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        _unlock(self._address)


__all__ = ["Channel", "ChannelLock"]
