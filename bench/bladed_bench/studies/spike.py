"""A neighbour's memory spike beside bladed's KV in memory (issue 46): the study is :mod:`bladed_bench.spike`
(its docstring says what is measured; its children run ``python -m bladed_bench.spike``)."""

from __future__ import annotations

from bladed_bench.spike import main

__all__ = ["main"]
