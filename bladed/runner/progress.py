"""What ``bladed-runner`` is doing, on stderr, while nothing else is printed.

Three kinds of output:

* ``step(text)``: a step that takes a while (converting a model, starting bladed, prefill). On a
  terminal it is one status line, rewritten in place (``\\r``) with the seconds spent so far, so a
  long step visibly lives; otherwise it is printed once as a plain line.
* ``status(text)``: a value that changes as it goes (decode tokens/s). On a terminal it replaces the
  status line each time; otherwise a plain line at most every ``interval`` seconds, so a log file
  gets an occasional line rather than a flood.
* ``note(text)``: a line worth keeping (the model was converted, the daemon started).

``off`` prints nothing (``--json``: stdout is the one JSON object and stderr only has errors).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Literal, TextIO

Mode = Literal["auto", "tty", "lines", "off"]


class Progress:
    """Progress lines on ``stream`` (default: stderr); ``auto`` is ``tty`` on a terminal, else ``lines``."""

    def __init__(self, mode: Mode = "auto", stream: TextIO | None = None, interval: float = 10.0,
                 tick: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "tty" if _isatty(self.stream) else "lines"
        self.mode = mode
        self.interval = interval
        self.tick = tick
        self._lock = threading.RLock()
        self._shown = False          # a status line is on the terminal
        self._step: tuple[str, float] | None = None
        self._last_line = float("-inf")
        self._wake = threading.Event()
        self._closed = False
        self._ticker: threading.Thread | None = None

    def step(self, text: str) -> None:
        """Start a step that takes a while: ``text`` and, on a terminal, its elapsed seconds."""
        with self._lock:
            if self.mode == "off":
                return
            self._step = (text, time.monotonic())
            if self.mode == "lines":
                self._line(text + " ...")
                return
            self._draw(text, " ...")
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="bladed-runner-progress", daemon=True)
                self._ticker.start()

    def status(self, text: str) -> None:
        """The current value of something that changes (ends the current step)."""
        with self._lock:
            self._step = None
            if self.mode == "tty":
                self._draw(text)
            elif self.mode == "lines" and time.monotonic() - self._last_line >= self.interval:
                self._line(text)

    def note(self, text: str) -> None:
        """A line that stays (ends the current step)."""
        with self._lock:
            self._step = None
            if self.mode != "off":
                self._erase()
                self._line(text)

    def clear(self) -> None:
        """End the current step or status; a terminal's status line is erased."""
        with self._lock:
            self._step = None
            self._erase()

    def close(self) -> None:
        self.clear()
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    # -- internals -----------------------------------------------------------------------------
    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last_line = time.monotonic()

    def _draw(self, text: str, suffix: str = "") -> None:
        # one terminal row: a longer line would wrap and \r would only return to its last row; the
        # text is cut, the suffix (the elapsed seconds) kept
        width = _columns(self.stream) - 1 - len(suffix)
        if len(text) > width:
            text = text[:max(0, width - 3)] + "..."
        self.stream.write("\r" + text + suffix + "\x1b[K")
        self.stream.flush()
        self._shown = True

    def _erase(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def _tick(self) -> None:
        # redraws the current step with its elapsed seconds; the wait is the redraw period, not a
        # synchronisation
        while not self._wake.wait(self.tick):
            with self._lock:
                if self._closed:
                    return
                if self._step is not None:
                    text, t0 = self._step
                    self._draw(text, f" ... {time.monotonic() - t0:.0f} s")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream: TextIO) -> int:
    try:
        cols = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        cols = 0
    return cols or 80  # 0: a terminal that never said its size


__all__ = ["Mode", "Progress"]
