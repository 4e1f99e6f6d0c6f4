"""Give freed heap memory back to the operating system (CPU runs).

glibc serves allocations below its mmap threshold (which grows up to 32 MB as
large blocks are freed) from the heap and keeps what is freed there for
reuse. After the update, that is about half a gigabyte of activations and
logit tiles (Gemma-3-270M, 512-token micro-batches) that generation does not
reuse, so the next rollout's own buffers stack on top of it. `malloc_trim`
returns it: measured in bf16, peak RSS over a step 5.97 -> 5.74 GB and
generation's peak 5.96 -> 5.44 GB, for 0.06-0.08 s per call and no slower steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None


def release_free_memory() -> bool:
    """Return free heap memory to the OS; False where this is not glibc on Linux."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
