"""Decode attention alone: B sequences at N tokens of context, one query each, over a stack of
layers' caches too large for the caches of the CPU, as a decode step reads them. Prints the
median ms per pass over the stack and the K/V bytes read per second.

    .venv/bin/python benchmarks/decode_attention.py --batch 64 --context 640 [--dtype float32]
        [--layers 30]

SmolLM2-135M's shape: 9 query heads on 3 KV heads of 64, 128-token blocks handed out in a
random order. bf16 caches sit in huge pages and fp32 ones in 4 KiB pages, as the engine
places them (worker/model_runner.py). With --layers 1 the caches stay in the CPU's caches,
which shows the kernel's arithmetic apart from memory. TREADLE_AMX=0 runs the vector kernel
in bf16. Time nothing else while it runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from treadle.kernels import hugepages
from treadle.kernels.cpu import cpu_kernels_available

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128


def kv_bytes(batch: int, context: int, layers: int, element_size: int) -> int:
    """The K and V a decode step of `batch` sequences at `context` tokens reads."""
    return layers * batch * context * KV_HEADS * HEAD_DIM * 2 * element_size


def attention_pass(batch: int, context: int, dtype: torch.dtype, layers: int) -> tuple[Callable[[], None], int]:
    """One pass of decode attention over `layers` layers' caches, as a decode step of `batch`
    sequences at `context` tokens reads them, and the K/V bytes it reads."""
    per_seq = -(-context // BLOCK)
    shape = (2, batch * per_seq + 1, BLOCK, KV_HEADS, HEAD_DIM)
    if dtype == torch.bfloat16:
        caches = [c.normal_() for c in hugepages.carve([(shape, dtype)] * layers)]
    else:
        caches = [torch.randn(shape, dtype=dtype) for _ in range(layers)]
    table = (torch.randperm(batch * per_seq) + 1).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)

    def one_pass() -> None:
        for cache in caches:
            torch.ops.treadle.paged_decode_attention(out, q, cache[0], cache[1], table, lens, HEAD_DIM ** -0.5)

    return one_pass, kv_bytes(batch, context, layers, q.element_size())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=15)
    ns = parser.parse_args()
    if not cpu_kernels_available(torch.device("cpu")):
        raise SystemExit("the CPU kernels are not built here (python -m treadle.kernels)")
    torch.manual_seed(0)
    one_pass, read = attention_pass(ns.batch, ns.context, getattr(torch, ns.dtype), ns.layers)

    for _ in range(3):
        one_pass()
    times = []
    for _ in range(ns.reps):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    ms = 1000 * statistics.median(times)
    print(f"{ns.dtype} batch {ns.batch} at {ns.context} tokens, {ns.layers} layers: {ms:.2f} ms, "
          f"{read / 1e6:.0f} MB of K/V at {read / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
