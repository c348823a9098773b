"""The C++ kernels compile for CPUs other than this one.

They are built with -march=native, so this machine's build never sees the code paths for an
older ISA, and an #ifdef that hides a name from one of them breaks every build on such a CPU
(it happened: a constant declared under __AVX512BF16__ but used outside it). Each source is
checked here, not built, for AVX-512 without BF16 or AMX (skylake-avx512) and for AVX2
(haswell), with the flags the real build uses.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from treadle.kernels import cpu

TARGETS = ("skylake-avx512", "haswell")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++, as the kernels' build does")
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
def test_kernels_compile_for_older_x86_cpus():
    flags = [f for f in cpu.CFLAGS if f != "-march=native"] + ["-std=c++20", "-fsyntax-only", "-w"]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    # one compiler per target, side by side: they take no torch threads
    checks = {march: subprocess.Popen(["g++", f"-march={march}", *flags, *includes, *map(str, cpu.SOURCES)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for march in TARGETS}
    failed = {}
    for march, proc in checks.items():
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failed[march] = out[-3000:]
    assert not failed, failed
