"""Moved to :mod:`bladed.kvstore` (one floor below the runner, shared with ``bladed.hf``).

Only ``engine.py``'s import line still names this module; it goes when that line reads
``from bladed.kvstore import ...``.
"""

from bladed.kvstore import Geometry, KVBackend, SlotTensors, StatsBook, dtype_bytes

__all__ = ["Geometry", "KVBackend", "SlotTensors", "StatsBook", "dtype_bytes"]
