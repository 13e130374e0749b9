"""Giving freed heap memory back to the operating system (glibc's `malloc_trim`).

A worker computes steps of ever different shapes (batch sizes, chunk lengths, context lengths):
every step allocates and frees tensors of new sizes, and glibc keeps the freed chunks in its
arenas (one per thread that allocated) for reuse. Fragmented, they stay resident: the process's
RSS climbs with every new mix of shapes although nothing is live (docs/RELIABILITY.md section
5, the soak). `malloc_trim(0)` returns the free pages of every arena; it takes milliseconds, so
the worker calls it only when idle (services/worker/loop.py), never between steps under load.

Only ctypes here. On a C library without `malloc_trim` (musl, macOS) `trim_heap` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Optional


def _load_malloc_trim() -> Optional[Callable[[int], int]]:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()  # resolved once at import; None where glibc is absent


def can_trim() -> bool:
    return _MALLOC_TRIM is not None


def trim_heap() -> bool:
    """Return free heap pages to the OS; True when some memory was released. Called by a
    process when it is idle (it walks every arena: milliseconds)."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))
