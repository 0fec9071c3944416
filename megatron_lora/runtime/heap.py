"""Give the C heap's free pages back to the operating system (glibc `malloc_trim`).

    release_free_heap()    # after a transient that should not stay resident

glibc serves a freed large CPU tensor's memory to later allocations but keeps its pages
resident, and once its dynamic mmap threshold has risen, allocations of several MB come from
the heap too: a loop of transients (a weight read, gathered, quantised, dropped) interleaved
with small long-lived tensors (the NF4 codes kept) leaves holes that the next, equal-sized
transient does not fit, so the resident set grows by about one transient per iteration.
`malloc_trim(0)` returns every free page, holes included. Measured on loading an NF4 base
(benchmarks/qlora.py, peak_load_bytes). A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_TRIM = []


def _malloc_trim():
    if not _TRIM:
        trim = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            trim = getattr(libc, "malloc_trim", None)
        except OSError:
            pass
        _TRIM.append(trim)
    return _TRIM[0]


def release_free_heap() -> None:
    """Return the heap's free pages to the OS (glibc); nothing elsewhere. Local, cheap (a walk
    of the free lists)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


__all__ = ["release_free_heap"]
