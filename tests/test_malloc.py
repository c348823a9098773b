"""glibc's malloc keeps what a step frees (worker/malloc.py): activations a layer frees are the
next layer's without new page faults. Each case runs in a fresh interpreter, since the setting
is process-wide and the thresholds glibc moves by itself depend on what the process did."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, resource, sys, torch
from treadle.worker.malloc import keep_freed_memory
# both cases start from glibc's first threshold, held fixed: left to move, it follows the
# process's history, and a fresh clone's run once kept every block without the tuning
ctypes.CDLL(None).mallopt(-3, 128 << 10)
if sys.argv[1] == "1":
    assert keep_freed_memory()
faults = []
for layer in range(8):   # a layer's activations: three of 8 MiB live at once, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    live = [torch.empty(8 << 18, dtype=torch.float32).fill_(1.0) for _ in range(3)]
    del live
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[5:]))   # once both settings have settled (the tuned heap takes up to four layers)
"""


def _late_faults(tuned: bool) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, "1" if tuned else "0"], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activations_come_back_without_page_faults():
    block_pages = (8 << 20) // 4096
    assert _late_faults(tuned=False) > 3 * block_pages   # each block unmapped, faulted again
    assert _late_faults(tuned=True) < block_pages // 4


def test_malloc_tuned_by_the_user_is_left_alone():
    probe = "from treadle.worker.malloc import keep_freed_memory; print(keep_freed_memory())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert done.stdout.split()[-1] == "False", done.stderr
