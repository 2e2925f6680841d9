"""Which engine moves a device's bytes: io_uring, or the portable thread pool.

Both are the C engine (``cffi_build/bladed_uring.c``) behind one interface
(:class:`bladed.io.uring.Ring`): the same slots, chunking (Eq. 7-11) and
completion rules; only how a command reaches the kernel differs.  ``auto``
picks io_uring where this process may use it and, for the nvme backend, where
the kernel has ``io_uring_cmd`` passthrough; otherwise the portable engine.
"""

from __future__ import annotations

from dataclasses import dataclass

URING = "uring"
PORTABLE = "portable"
AUTO = "auto"
#: the values of ``io.engine``
SETTINGS = (AUTO, URING, PORTABLE)
#: the C ``enum bd_engine`` value of each engine
C_ENGINE = {URING: 0, PORTABLE: 1}


@dataclass(frozen=True)
class EngineChoice:
    """The engine a backend runs on and why (logged once at start, shown by status and check)."""

    engine: str
    reason: str

    def describe(self) -> str:
        return f"{self.engine} ({self.reason})"


class EngineSettingError(ValueError):
    """An ``io.engine`` that cannot run here: unknown, or ``"uring"`` where io_uring is refused."""


def _uring_missing(backend: str) -> str | None:
    """Why io_uring cannot drive ``backend`` in this process, or None (probes the kernel once)."""
    from bladed.io import features

    uring = features.io_uring()
    if not uring.available:
        return f"io_uring unavailable: {uring.detail}"
    if backend == "nvme":
        cmd = features.io_uring_cmd()
        if not cmd.available:
            return f"no io_uring_cmd: {cmd.detail}"
    return None


def choose(setting: str, backend: str) -> EngineChoice:
    """Resolve ``io.engine`` for ``backend``; ``auto`` (and ``uring``, to refuse early) probe this process's
    kernel and sandbox."""
    if setting not in SETTINGS:
        raise EngineSettingError(f"io.engine: must be one of {', '.join(repr(e) for e in SETTINGS)}, "
                                 f"got {setting!r}")
    if setting == PORTABLE:
        return EngineChoice(PORTABLE, "io.engine")
    missing = _uring_missing(backend)
    if setting == URING:
        if missing:
            raise EngineSettingError(f'io.engine = "uring" but {missing}: set io.engine = "auto" '
                                         f'(or "portable") to run on the portable engine')
        return EngineChoice(URING, "io.engine")
    return EngineChoice(PORTABLE, missing) if missing else EngineChoice(URING, "io_uring available")


def c_engine(engine: str) -> int:
    """The C engine number of a resolved engine name (``uring`` or ``portable``)."""
    try:
        return C_ENGINE[engine]
    except KeyError:
        raise ValueError(f"engine {engine!r}: choose {URING} or {PORTABLE}") from None
