"""One channel of a session: an io_uring (``Engine``) and one staging slot, used by one thread at a time.

A client copy thread drives one channel over its own data connection, and
the daemon serves that connection's requests on the connection's thread: the
request runs where it arrives, with no queue or worker in between.  Requests
on different channels run in parallel threads (cffi drops the GIL inside the
engine), so two copy threads overlap their storage I/O (overlap-intra,
paper §IV-C).  The lock only matters when something else borrows the channel
(a JSON ``read``/``write`` on the control connection, a live demotion, the
session's teardown waiting for the request in flight).

Each channel's ring reads through a window (``io.read_window_bytes``,
default :data:`READ_WINDOW_BYTES`), so that small writes of other channels
pass its bulk reads at the device.
"""

from __future__ import annotations

import threading

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
        self.lock = threading.Lock()
        self.busy_ns = 0
        self.ops = 0

    def close(self) -> None:
        """Close the ring and let go of the slot (the caller holds :attr:`lock`)."""
        self.engine.close()
        self.slot.close()


__all__ = ["Channel"]
