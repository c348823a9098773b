"""Prefill attention alone: treadle's paged kernel against vLLM-CPU's, for one prompt of N
tokens at SmolLM2's shape (9 query heads on 3 KV heads of 64), ms per layer, median of 30
calls after 5 warm-up calls.

    .venv/bin/python benchmarks/peers/attention.py [--lengths 128,288,512,1024] [--dtypes fp32,bf16]

Each kernel runs in its own engine's interpreter, one after the other: treadle's in this one,
vLLM's in its virtual environment (setup.sh) with the environment run.py gives it. Both read
random K/V from scattered blocks of each engine's default size (16 and 128 tokens), and both
get the whole prompt as one causal span. Time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def median_call_s(fn: Callable[[], None], calls: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scattered_table(num_blocks: int) -> torch.Tensor:
    """One span's block table: num_blocks blocks picked at random from twice as many."""
    return torch.randperm(2 * num_blocks, dtype=torch.int32)[:num_blocks].reshape(1, -1).contiguous()


def treadle_call(n: int, dtype: torch.dtype) -> Callable[[], None]:
    from treadle.kernels.cpu import cpu_kernels_available
    if not cpu_kernels_available(torch.device("cpu")):
        raise RuntimeError("treadle's CPU kernels did not build")
    block = 16
    table = scattered_table(-(-n // block))
    k_cache = torch.randn(2 * table.numel(), block, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    query_start = torch.tensor([0, n], dtype=torch.int32)
    context_lens = torch.zeros(1, dtype=torch.int32)
    return lambda: torch.ops.treadle.paged_prefill_attention(
        out, q, k_cache, v_cache, table, query_start, context_lens, HEAD_DIM ** -0.5)


def vllm_call(n: int, dtype: torch.dtype) -> Callable[[], None]:
    import vllm._custom_ops as ops
    block = 128   # vLLM-CPU's default; its "vec" kernel wants a multiple of 32
    table = scattered_table(-(-n // block))
    # vLLM's layout: [blocks, kv_heads, 2 * block, head_dim], K then V in each block.
    kv = torch.randn(2 * table.numel(), KV_HEADS, 2 * block, HEAD_DIM).to(dtype)
    k_cache, v_cache = kv.chunk(2, dim=2)
    q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    query_start = torch.tensor([0, n], dtype=torch.int32)
    seq_lens = torch.tensor([n], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False)
    return lambda: ops.cpu_attention_with_kv_cache(
        query=q, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=query_start,
        seq_lens=seq_lens, scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)


def measure(engine: str, lengths: list[int], dtypes: list[str]) -> list[dict]:
    torch.set_num_threads(2)
    make = treadle_call if engine == "treadle" else vllm_call
    return [{"engine": engine, "dtype": d, "tokens": n, "ms": 1e3 * median_call_s(make(n, DTYPES[d]))}
            for d in dtypes for n in lengths]


def gflops(tokens: int, ms: float) -> float:
    """Causal attention's useful work: QK and PV over the lower triangle."""
    return HEADS * tokens * tokens / 2 * HEAD_DIM * 4 / (ms * 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,288,512,1024")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--engine", choices=("treadle", "vllm"),
                        help="time one engine's kernel here and print JSON (how the runner calls it)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    dtypes = args.dtypes.split(",")
    if args.engine:
        print(json.dumps(measure(args.engine, lengths, dtypes)))
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run   # the peers' locations and vLLM's environment

    rows = measure("treadle", lengths, dtypes)
    vllm = subprocess.run([str(run.PEERS / "vllm/bin/python"), __file__, "--engine", "vllm",
                           "--lengths", args.lengths, "--dtypes", args.dtypes],
                          env=run.vllm_env(), capture_output=True, text=True, cwd="/tmp")
    if vllm.returncode != 0:
        raise RuntimeError(f"vLLM's run failed:\n{vllm.stderr[-2000:]}")
    theirs = {(r["dtype"], r["tokens"]): r["ms"] for r in json.loads(vllm.stdout.splitlines()[-1])}
    print("| dtype | tokens | treadle ms/layer (GFLOP/s) | vLLM ms/layer (GFLOP/s) | treadle's time / vLLM's |")
    print("|---|---|---|---|---|")
    for r in rows:
        key = (r["dtype"], r["tokens"])
        print(f"| {r['dtype']} | {r['tokens']} | {r['ms']:.3f} ({gflops(r['tokens'], r['ms']):.0f}) | "
              f"{theirs[key]:.3f} ({gflops(r['tokens'], theirs[key]):.0f}) | {r['ms'] / theirs[key]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
