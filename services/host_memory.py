"""Handing freed heap memory back to the operating system (glibc's `malloc_trim`).

glibc keeps what a process frees in its arenas for reuse, one arena per thread that allocates,
up to 8 per core. A learner allocates and frees tensors of a different size each step from
PyTorch's and Ray's threads, and its resident memory climbs with what its arenas hold but no
longer use: a 30-minute soak of the demo grew its learner from 1,025 to 1,372 MiB; in another
run its arenas held 735 MiB of which 167 MiB were in use, and one `malloc_trim(0)` returned
304 MiB (docs/reliability.md, soak). Trimming now and then bounds that at no measurable cost;
making every large allocation a mapping of its own (`MALLOC_MMAP_THRESHOLD_`) bounds it too but
slowed the demo's steps by about a third.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    return trim


def release_free_heap() -> bool:
    """Return the free memory of every malloc arena to the OS; whether any was returned (False
    also where the C library has no `malloc_trim`)."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1
