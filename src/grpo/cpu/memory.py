"""The CPU's memory: freed heap back to the operating system, and huge pages for torch.

glibc serves allocations below its mmap threshold (which grows up to 32 MB as
large blocks are freed) from the heap and keeps what is freed there for
reuse. After the update, that is about half a gigabyte of activations and
logit tiles (Gemma-3-270M, 512-token micro-batches) that generation does not
reuse, so the next rollout's own buffers stack on top of it. `malloc_trim`
returns it (measured: docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
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


def use_huge_pages() -> None:
    """Back torch's large CPU tensors (logit tiles, activations, gradients, allocated and freed
    every step) with transparent huge pages, which cuts the page faults of re-allocating them.
    torch reads THP_MEM_ALLOC_ENABLE once, at its first CPU allocation, so a program calls this at
    its start (grpo's CLI does, for a run with cpu.enabled); an importing library must not set its
    caller's environment, so `import grpo` does not."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
