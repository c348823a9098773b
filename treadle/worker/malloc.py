"""glibc's malloc, told to keep the memory a step frees for the next layer to reuse.

Each layer of a step allocates and frees activations of the same few sizes (a 2,000-token
bf16 prefill: up to 12 MiB each). By default glibc serves blocks past a threshold that moves
(128 KiB at first) with mmap and unmaps them on free, and gives the heap's free top back to
the kernel past another; either way the next layer's allocation comes back from the kernel
a page at a time. A 2,000-token bf16 prefill took 48,000-107,000 minor page faults and
478-547 ms; with both thresholds fixed high, 11,300 and 450-464 ms (docs/performance-log.md).
vLLM's CPU backend gets the same from the tcmalloc it preloads.

Every thread shares the main arena, too. glibc gives a thread that allocates an arena of its
own, which grows in heaps of at most 64 MiB and unmaps each heap that empties, whatever the
trim threshold. `treadle serve` steps the model on AsyncLLM's engine thread: 32 prompts (9,603
tokens) took 340,000-390,000 page faults in fp32 and 170,000-210,000 in bf16, and the last
first token came 5-10% later than with one arena (docs/performance-log.md). A thread's arena is
fixed at its first allocation, so this must run before such a thread starts.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20    # glibc's largest: blocks up to this size come from the heap
TRIM_THRESHOLD = 512 << 20   # free heap top kept before any goes back to the kernel

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Fix both thresholds and one arena, once per process; returns whether they are set. Call
    it before starting a thread that will run steps. Left alone where
    the user tuned malloc (MALLOC_*_ or GLIBC_TUNABLES) or the C library is not glibc."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or "GLIBC_TUNABLES" in os.environ:
        logger.debug("malloc tuned by the environment; leaving it")
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version   # glibc only: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                    and mallopt(M_ARENA_MAX, 1))
    return _applied


def return_freed_memory() -> None:
    """Give the heap's free memory back to the kernel once (glibc's malloc_trim): for the
    temporaries of loading and packing, which the thresholds above would otherwise keep for
    the life of the process (about 450 MB for SmolLM2 in fp32). Steps grow the heap again to
    their own working set and keep that."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
