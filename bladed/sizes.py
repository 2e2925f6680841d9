"""Byte sizes and round-ups that every floor shares (``docs/architecture.md``, floor 0).

Imports nothing from bladed, so the I/O floor and the residency floor can both use it.
"""

from __future__ import annotations

import mmap

#: the host's memory page: the unit of the page cache, of ``mmap`` and of ``mincore``
PAGE_SIZE = mmap.PAGESIZE


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` for integers (``d > 0``)."""
    return -(-n // d)


def align_up(n: int, unit: int) -> int:
    """The smallest multiple of ``unit`` that is >= ``n``."""
    return ceil_div(n, unit) * unit


__all__ = ["PAGE_SIZE", "align_up", "ceil_div"]
