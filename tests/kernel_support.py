"""What the kernel tests ask of this machine: whether the C++ kernels built, and which of the
instruction sets their fast paths need the CPU has. Shared by the kernel test modules."""

from __future__ import annotations

import pytest
import torch

from treadle.kernels import cpu
from treadle.kernels.cpu import cpu_kernels_available

CPU = torch.device("cpu")
# CI requires the kernels (TREADLE_REQUIRE_CPU_KERNELS=1): there a missing build fails loudly
# in cpu_kernels_available instead of skipping.
needs_kernels = pytest.mark.skipif(not cpu_kernels_available(CPU), reason="the C++ kernels did not build here")
HAS_AMX = cpu.cpu_has(*cpu.AMX_FLAGS)
HAS_PAIRS = cpu.cpu_has("avx512_bf16")   # the bf16 pairs' AVX512-BF16
HAS_AVX512 = cpu.cpu_has("avx512f")
