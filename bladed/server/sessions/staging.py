"""Admitting a session's staging memory: the client's memfd, sized and sealed, and whether the daemon's
memory holds it beside its working reserve.  Must not touch storage."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator

from bladed.protocol import ErrorCode, RequestError
from bladed.residency.budget import BudgetBreakdown
from bladed.server.storage.extent_store import BOUNCE_BYTES

#: room for the daemon's own heap growth while it serves sessions (``working_reserve_bytes``)
HEAP_RESERVE_BYTES = 4 << 20


def working_reserve_bytes(channels: int) -> int:
    """Memory the daemon may need beside a new session's staging while it serves it, none of which the
    kernel can reclaim: a bounce buffer per channel, a demotion's and an extent move's copy buffers, and
    room for its own heap (:func:`check_staging_fits`)."""
    return (channels + 2) * BOUNCE_BYTES + HEAP_RESERVE_BYTES


def check_staging_fits(b: BudgetBreakdown, channels: int, stride: int) -> None:
    """Refuse a session whose staging does not fit the daemon's memory (Eq. 1's ``M*`` without M_free's absorb
    floor, ``staging_usable_bytes``, with the staging of the open sessions not charged yet, and
    :func:`working_reserve_bytes` beside it): the daemon touches that memory when it serves the session, and a
    memory cgroup answers with the OOM killer, which would end every session, not with an error."""
    need = b.pinned_uncharged_bytes + working_reserve_bytes(channels)
    if b.staging_usable_bytes >= need:
        return
    raise RequestError(ErrorCode.NO_MEMORY,
                       f"the session's staging ({channels} x {stride} bytes) does not fit in the daemon's memory: "
                       f"{max(0, b.staging_usable_bytes)} bytes usable (M*: limit {b.memory_limit_bytes} of "
                       f"{b.memory_limit_source} less {b.anon_shmem_bytes} anon+shmem), {need} needed with the "
                       f"open sessions' staging and the daemon's working reserve; open it with fewer channels or "
                       f"a smaller slot, or raise the daemon's memory limit (MemoryMax=)")


@contextlib.contextmanager
def passed_memfd(op: str, fds: list[int]) -> Iterator[int]:
    """The one staging memfd request ``op`` passed with SCM_RIGHTS; every descriptor passed is closed after (the
    daemon keeps its own mapping)."""
    try:
        if len(fds) != 1:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{op} needs exactly one staging memfd passed with SCM_RIGHTS, "
                                                      f"got {len(fds)} descriptors")
        yield fds[0]
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def prepare_memfd(fd: int, need: int) -> None:
    """The staging descriptor must be a memfd sealed against shrinking and big enough.

    An empty memfd that may still grow is sized here to ``need`` bytes and
    sealed (what :class:`bladed.client.Client` sends: the daemon owns the
    layout).  A shrinkable mapping could be truncated by the client under the
    daemon's feet, and touching it would then kill the daemon with SIGBUS;
    the size is checked after the seal, so a client racing to shrink it loses.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging descriptor must be a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging descriptor must be a memfd "
                           "(memfd_create with MFD_ALLOW_SEALING)") from None
    if st.st_size == 0 and not seals & (fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL):
        try:
            os.ftruncate(fd, need)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, f"cannot size and seal the empty staging memfd to {need} "
                               f"bytes: {e.strerror or e}") from None
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RequestError(ErrorCode.BAD_REQUEST, "the staging memfd must be sealed with F_SEAL_SHRINK, or be "
                           "empty and not sealed (the daemon then sizes and seals it)")
    if st.st_size < need:
        raise RequestError(ErrorCode.BAD_REQUEST, f"the staging memfd has {st.st_size} bytes, {need} announced")


__all__ = ["HEAP_RESERVE_BYTES", "check_staging_fits", "passed_memfd", "prepare_memfd", "working_reserve_bytes"]
