"""C++ kernels for CPU (csrc/), registered as `torch.ops.treadle.*` and built on first use.

- `paged_decode_attention`: decode attention that reads K/V straight out of the block table,
  where the torch path gathers them into a dense buffer and SDPA reads them again. A long
  sequence is split into parts that threads share, merged after (decode_items.h). In bf16 on
  a CPU with AMX its scores run on tiles (paged_decode_amx.cpp).
- `paged_prefill_attention`: the same for prefill chunks (causal, after any cached context),
  all of a step's chunks in one call where the torch path makes a gather, a mask and an SDPA
  call per chunk. In bf16 on a CPU with AMX its products run on tiles (paged_prefill_amx.cpp;
  TREADLE_AMX=0 keeps the vector code).
- `small_rows_linear`: a linear layer at a few rows (small-batch decode; `linear.SMALL_ROWS`),
  which streams each weight row once where oneDNN's GEMM, tuned for many rows, reads weights
  at about half that rate.
- `int8_rows_linear`: the same over weight-only int8 rows (`quantization="int8"`,
  `linear.INT8_ROWS`), and `gguf_rows_linear` over a GGUF file's own Q4_0, Q4_1 and Q8_0
  blocks (`quantization="gguf"`, models/gguf_weights.py).
- `tiles_linear`: a bf16 linear layer on AMX tiles from a few rows to a few dozen (decode at
  larger batch; `linear.TILE_FROM_ROWS`, `linear.TILE_ROWS`), over the weight packed once as
  tiles (`pack_linear_tiles`), where the CPU has AMX. Without AMX but with AVX512-BF16 the
  same calls run bf16 over panels of input pairs (linear_pairs.cpp), from 1 row to
  `linear.PAIR_ROWS`. In fp32 they run an AVX-512 kernel over the weight packed as panels of
  32 outputs (linear_panels.cpp), from 2 rows to `linear.PANEL_ROWS`.
- `bf16x3_linear`: an fp32 linear past `linear.PANEL_ROWS` (prefill) on AMX tiles, each value
  split into three bf16 parts and six of their products summed in fp32: as precise as an fp32
  GEMM (linear_bf16x3.cpp), where the CPU has AMX.
- `LayerStack` (a class): a stage's decoder layers over these kernels in one call per step
  (models/layer_stack.py).
- `rms_norm`, `silu_and_mul`, `rope_`: one pass over memory each, where the torch
  expressions they replace make three to five.

torch.utils.cpp_extension compiles them once per source, torch installation and CPU (they
use -march=native) into TREADLE_KERNEL_DIR, by default the `kernels` folder of the treadle cache
(~/.cache/treadle or TREADLE_CACHE_DIR); later processes only load the library. Without a
compiler, or with TREADLE_CPU_KERNELS=0, the model runs its plain torch path, op for op as
transformers does; TREADLE_REQUIRE_CPU_KERNELS=1 (for CI) makes a failed build an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

from treadle.models.loader import cache_root

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# -ffast-math lets GCC vectorise exp (glibc's libmvec) and the reductions; the kernels never
# feed it an inf or a NaN. No FMA contraction: products round as torch's do. On x86, GCC's
# tuning for Intel's server cores vectorises loops 256 bits wide even with AVX-512 (libmvec's
# 8-lane exp included): 512 made the prefill attention 2-2.5x faster on one (docs/performance-log.md).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-ffp-contract=off"]
if platform.machine().lower() in ("x86_64", "amd64"):
    CFLAGS.append("-mprefer-vector-width=512")

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


# What the AMX kernels need (they are built for the machine's own CPU, -march=native).
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `flags` (never where it cannot be read)."""
    return set(flags) <= set(_cpu_flags().split())


def kernel_root() -> Path:
    """Where kernel builds live: TREADLE_KERNEL_DIR, else `kernels` in the treadle cache."""
    return Path(os.environ.get("TREADLE_KERNEL_DIR") or Path(cache_root()) / "kernels")


def build_name() -> str:
    """The build's folder and library name, one per source, flags, CPU and torch installation.

    Two venvs with the same torch version link against different libtorch files, and ninja
    rebuilds when the source paths in its build file change; keyed by both, each installation
    keeps its own build instead of rebuilding another's in turn.
    """
    where = [str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parent)]
    parts = [p.read_text() for p in SOURCES + HEADERS] + [torch.__version__, *where, " ".join(CFLAGS),
                                                _cpu_flags()]
    return "treadle_cpu_" + hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


def _build_and_load() -> bool:
    from torch.utils.cpp_extension import load

    name = build_name()
    build_dir = kernel_root() / name
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's own lock is a plain file: a process killed while holding it (a worker shot
        # mid-start) leaves it behind, and every later load waits on it forever. An flock dies
        # with its holder; whoever holds it knows no one else is building, so a torch lock it
        # finds is stale.
        with open(build_dir / ".treadle-lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                 extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                 is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only home: the torch path still works
        if os.environ.get("TREADLE_REQUIRE_CPU_KERNELS") == "1":
            raise RuntimeError(f"TREADLE_REQUIRE_CPU_KERNELS=1, but the CPU kernels failed to "
                               f"build or load in {build_dir}: {e}") from e
        logger.warning("CPU kernels unavailable, the model runs its slower torch path: %s", e)
        return False
    logger.info("CPU kernels ready in %.1fs (%s)", time.perf_counter() - start, build_dir)
    return True
