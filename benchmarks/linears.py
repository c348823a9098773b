"""treadle's linear kernels on one weight shape at a time: the AMX tile kernel or, without AMX,
the AVX512-BF16 pairs kernel (bf16), or the AVX-512 panel kernel (fp32; all "tiles" in the
table), in fp32 the AMX kernel over three bf16 parts ("bf16x3"), oneDNN's packed GEMM and the
few-row kernel, µs per call (median of --reps after a warm-up) and TFLOP/s. In a process with
treadle's malloc settings, as the engine runs them.

    .venv/bin/python benchmarks/linears.py [--rows 16,64,288,1024] [--shapes 960x576,3072x576]
        [--dtype bfloat16] [--layers 30]

Shapes are OUTxIN (SmolLM2's qkv, o, gate_up and down by default). With --layers N each timed
call runs over N weights of the shape in turn and the table shows µs per weight: the weights
then come from memory, as in a model's step, rather than from the CPU's caches. Time nothing
else while it runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from treadle.kernels.cpu import cpu_kernels_available
from treadle.models import linear
from treadle.worker.malloc import keep_freed_memory


def median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,288,512,1024,2048")
    parser.add_argument("--shapes", default="960x576,576x576,3072x576,576x1536")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=1, help="weights of each shape, run in turn")
    ns = parser.parse_args()
    if not cpu_kernels_available(torch.device("cpu")):
        raise SystemExit("treadle's CPU kernels did not build")
    keep_freed_memory()
    dtype = getattr(torch, ns.dtype)
    print("| shape | rows | kernel | µs | TFLOP/s |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for shape in ns.shapes.split(","):
            out_f, in_f = (int(v) for v in shape.split("x"))
            ws = [torch.randn(out_f, in_f, dtype=dtype) / in_f ** 0.5 for _ in range(ns.layers)]
            packed, tiles = [linear.pack(w) for w in ws], [linear.pack_tiles(w) for w in ws]
            bf16x3 = [torch.ops.treadle.pack_linear_bf16x3(w) for w in ws
                      if torch.ops.treadle.linear_bf16x3_ready(w)]
            for rows in (int(r) for r in ns.rows.split(",")):
                x = torch.randn(rows, in_f, dtype=dtype)
                kernels = {"oneDNN": lambda: [linear.linear(x, w, None, p) for w, p in zip(ws, packed)]}
                if tiles[0] is not None:
                    kernels["tiles"] = lambda: [torch.ops.treadle.tiles_linear(x, t, None) for t in tiles]
                if bf16x3:
                    kernels["bf16x3"] = lambda: [torch.ops.treadle.bf16x3_linear(x, b, None) for b in bf16x3]
                if rows <= 8:
                    kernels["few-row"] = lambda: [torch.ops.treadle.small_rows_linear(x, w, None) for w in ws]
                for name, fn in kernels.items():
                    us = median_us(fn, ns.reps) / ns.layers
                    print(f"| {shape} | {rows} | {name} | {us:.0f} | {2 * rows * out_f * in_f / us / 1e6:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
