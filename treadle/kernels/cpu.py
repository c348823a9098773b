"""C++ kernels for CPU (csrc/), registered as `torch.ops.treadle.*` and built on first use.

- `paged_decode_attention`: decode attention that reads K/V straight out of the block table,
  where the torch path gathers them into a dense buffer and SDPA reads them again.
- `rms_norm`, `silu_and_mul`, `rope_`: one pass over memory each, where the torch
  expressions they replace make three to five.

torch.utils.cpp_extension compiles them once per source, torch version and CPU (they use
-march=native) into TREADLE_KERNEL_DIR, by default ~/.cache/treadle/kernels; later processes
only load the library. Without a compiler, or with TREADLE_CPU_KERNELS=0, the model runs
its plain torch path, op for op as transformers does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
# -ffast-math lets GCC vectorise exp (glibc's libmvec) and the reductions; the kernels never
# feed it an inf or a NaN. No FMA contraction: products round as torch's do.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-ffp-contract=off"]

_lock = threading.Lock()
_loaded: bool | None = None


def cpu_kernels_available(device: torch.device) -> bool:
    """Whether the `torch.ops.treadle` kernels serve the model on `device`."""
    global _loaded
    if device.type != "cpu" or os.environ.get("TREADLE_CPU_KERNELS", "1") == "0":
        return False
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load()
        return _loaded


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_and_load() -> bool:
    from torch.utils.cpp_extension import load

    parts = [p.read_text() for p in SOURCES] + [torch.__version__, " ".join(CFLAGS), _cpu_flags()]
    name = "treadle_cpu_" + hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TREADLE_KERNEL_DIR", Path.home() / ".cache" / "treadle" / "kernels"))
    build_dir = root / name
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only home: the torch path still works
        logger.warning("CPU kernels unavailable, the model runs its slower torch path: %s", e)
        return False
    logger.info("CPU kernels ready in %.1fs (%s)", time.perf_counter() - start, build_dir)
    return True
