"""The C++ kernels compile for CPUs other than this one.

They are built with -march=native, so this machine's build never sees the code paths for an
older ISA, and an #ifdef that hides a name from one of them breaks every build on such a CPU
(it happened: a constant declared under __AVX512BF16__ but used outside it). Each source is
checked here, not built, for AVX-512 without BF16 or AMX (skylake-avx512) and for AVX2
(haswell), with the flags the real build uses.

Every source opens with the same include of torch's headers, and parsing those is nearly all
of a check's time; so each target precompiles them once, with its own flags, and checks every
source on top. Only the sources' own code changes with the target's macros past that line.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from treadle.kernels import cpu

TARGETS = ("skylake-avx512", "haswell")
FIRST_INCLUDE = "#include <ATen/ATen.h>"   # every source's first directive


def _first_directive(source: Path) -> str:
    return next(line.strip() for line in source.read_text().splitlines() if re.match(r"\s*#", line))


def _check(march: str, folder: Path) -> str | None:
    """Checks every source for `march`: torch's headers precompiled for it (a header of the
    sources' first include, in `folder`), then each source, past it, with -fsyntax-only.
    Returns g++'s output where either step fails."""
    flags = [f"-march={march}", *(f for f in cpu.CFLAGS if f != "-march=native"), "-std=c++20", "-w",
             *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}"]
    header = folder / f"{march}.h"
    header.write_text(FIRST_INCLUDE + "\n")
    steps = (["g++", *flags, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
             ["g++", *flags, "-fsyntax-only", "-include", str(header), *map(str, cpu.SOURCES)])
    for step in steps:
        done = subprocess.run(step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        if done.returncode != 0:
            return done.stdout[-3000:]
    return None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++, as the kernels' build does")
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
def test_kernels_compile_for_older_x86_cpus():
    # The precompiled header stands for each source's own first line only if it is that line.
    assert {s.name: _first_directive(s) for s in cpu.SOURCES} == {s.name: FIRST_INCLUDE for s in cpu.SOURCES}
    # one target per compiler, side by side: they take no torch threads. The precompiled
    # headers (some 400 MB each) go with the folder.
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(len(TARGETS)) as pool:
        outputs = dict(zip(TARGETS, pool.map(lambda march: _check(march, Path(folder)), TARGETS)))
    failed = {march: out for march, out in outputs.items() if out is not None}
    assert not failed, failed
