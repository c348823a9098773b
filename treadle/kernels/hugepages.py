"""Memory in 2 MiB pages for the tensors the CPU kernels stream at decode: the weights, their
tile and weight-only (int8, GGUF) copies, and a bf16 KV cache.

A decode step reads every weight once. In 4 KiB pages that is a TLB miss every 4 KiB, and in
a VM each miss walks two page tables (the guest's, then the host's). On the 2-core Xeon VM,
one thread read 1 GiB at 4-6 GB/s in 4 KiB pages and 12-13 GB/s in 2 MiB pages, and a bf16
decode step's linear layers took 18.8 ms against 13.6 at one row, 31.2 against 24.6 at 56
(docs/performance-log.md, "weights in huge pages"). A bf16 KV cache is read 25-40% faster here;
an fp32 one stays out: no gain of its steps was shown ("huge pages, again").

Linux gives a private anonymous mapping transparent huge pages where it is asked to with
madvise(MADV_HUGEPAGE) before the pages are first touched, and THP is not switched off
("never" in /sys/kernel/mm/transparent_hugepage/enabled, or TREADLE_HUGEPAGES=0 here). The
memory is an mmap of its own, given back to the kernel when the last tensor on it goes.
Elsewhere, or where the kernel refuses, the same calls return ordinary memory.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64   # each tensor carved from a region starts on a cache line

_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def enabled() -> bool:
    """Whether regions are asked for huge pages: Linux with THP not off, and not
    TREADLE_HUGEPAGES=0 (to compare with and without)."""
    if os.environ.get("TREADLE_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def region(nbytes: int) -> torch.Tensor:
    """`nbytes` of uninitialised memory as a uint8 tensor, starting on a 2 MiB boundary and in
    huge pages where `enabled()`; the pages are backed as they are first written."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    if not enabled():
        return torch.empty(nbytes, dtype=torch.uint8)
    # Private and anonymous (a shared mapping would be shmem, which THP leaves alone here);
    # one spare huge page, since the mapping need not start on a 2 MiB boundary.
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:   # a kernel without THP: ordinary pages
        logger.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    whole = torch.frombuffer(m, dtype=torch.uint8)   # holds the mapping until the last view goes
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def carve(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised contiguous tensors of these shapes and dtypes, side by side in one
    `region`."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-_nbytes(shape, dtype) // ALIGN) * ALIGN
    memory = region(total)
    return [memory[at:at + _nbytes(shape, dtype)].view(dtype).view(shape)
            for at, (shape, dtype) in zip(offsets, specs)]


def gather(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Contiguous copies of `tensors` in one `region`, in their order (None stays None; a
    tensor given twice is copied once, and both places get the copy)."""
    unique = {id(t): t for t in tensors if t is not None}
    copies = carve([(t.shape, t.dtype) for t in unique.values()])
    by_id = {key: copy.copy_(t) for (key, t), copy in zip(unique.items(), copies)}
    return [None if t is None else by_id[id(t)] for t in tensors]


def huge_bytes() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages (for tests and
    benchmarks)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
