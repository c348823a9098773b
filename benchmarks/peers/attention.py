"""Attention alone: treadle's paged kernels against vLLM-CPU's at SmolLM2's shape (9 query
heads on 3 KV heads of 64), ms per layer: the median of 30 rounds after 5 warm-up rounds. By
default one prompt of N tokens (prefill); with --decode B, B sequences of N tokens of context,
one new query each (a decode step).

    .venv/bin/python benchmarks/peers/attention.py [--lengths 128,288,512,1024] [--dtypes fp32,bf16]
    .venv/bin/python benchmarks/peers/attention.py --decode 64 --lengths 128,360,1024

Each kernel runs in its own engine's interpreter, one after the other: treadle's in this one,
vLLM's in its virtual environment (setup.sh) with the environment run.py gives it. Both read
random K/V from scattered blocks of each engine's default size (16 and 128 tokens; --block
sets treadle's), and both
get a prompt as one causal span. vLLM's kernel is the one its server picks for the dtype and
CPU ("amx" for bf16 on a CPU with AMX tiles, "vec" otherwise). Time nothing else while it runs.
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


def median_call_s(fns: list[Callable[[], None]], rounds: int = 30, warmup: int = 5) -> float:
    """Median over rounds of the mean time of one call, each round calling every fn once."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for fn in fns:
            fn()
        times.append((time.perf_counter() - start) / len(fns))
    return statistics.median(times)


def scattered_tables(batch: int, num_blocks: int) -> torch.Tensor:
    """batch spans' block tables, num_blocks each, on distinct blocks picked at random from
    twice as many."""
    return torch.randperm(2 * batch * num_blocks, dtype=torch.int32)[:batch * num_blocks].reshape(
        batch, num_blocks).contiguous()


def treadle_call(n: int, dtype: torch.dtype, batch: int, block: int = 16) -> Callable[[], None]:
    """batch 0: one prompt of n tokens; otherwise `batch` decodes at n tokens of context, on
    KV blocks of `block` tokens."""
    from treadle.kernels.cpu import cpu_kernels_available
    if not cpu_kernels_available(torch.device("cpu")):
        raise RuntimeError("treadle's CPU kernels did not build")
    table = scattered_tables(max(batch, 1), -(-n // block))
    k_cache = torch.randn(2 * table.numel(), block, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch or n, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    if batch:
        seq_lens = torch.full((batch,), n, dtype=torch.int32)
        return lambda: torch.ops.treadle.paged_decode_attention(
            out, q, k_cache, v_cache, table, seq_lens, HEAD_DIM ** -0.5)
    query_start = torch.tensor([0, n], dtype=torch.int32)
    context_lens = torch.zeros(1, dtype=torch.int32)
    return lambda: torch.ops.treadle.paged_prefill_attention(
        out, q, k_cache, v_cache, table, query_start, context_lens, HEAD_DIM ** -0.5)


def vllm_call(n: int, dtype: torch.dtype, batch: int, block: int = 128) -> Callable[[], None]:
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    # The kernel's AMX tiles need the kernel's leave (XTILEDATA), which a server has from
    # oneDNN's first bf16 GEMM; alone, it would stop at SIGILL.
    torch.cpu._init_amx()
    spans = max(batch, 1)
    table = scattered_tables(spans, -(-n // block))
    # vLLM's layout: [blocks, kv_heads, 2 * block, head_dim], K then V in each block.
    kv = torch.randn(2 * table.numel(), KV_HEADS, 2 * block, HEAD_DIM).to(dtype)
    k_cache, v_cache = kv.chunk(2, dim=2)
    q = torch.randn(batch or n, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    query_start = (torch.arange(spans + 1, dtype=torch.int32) if batch
                   else torch.tensor([0, n], dtype=torch.int32))
    seq_lens = torch.full((spans,), n, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=spans, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1,
        isa=_get_attn_isa(dtype, block, HEAD_DIM),   # the kernel its server picks: "amx" for bf16 where the CPU has AMX
        enable_kv_split=False)
    return lambda: ops.cpu_attention_with_kv_cache(
        query=q, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=query_start,
        seq_lens=seq_lens, scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)


def kv_bytes(dtype: str, tokens: int, batch: int) -> int:
    """The K and V bytes of `batch` spans of `tokens` (one span for a prompt, batch 0)."""
    return 2 * max(batch, 1) * tokens * KV_HEADS * HEAD_DIM * DTYPES[dtype].itemsize


def measure(engine: str, lengths: list[int], dtypes: list[str], batch: int, block: int) -> list[dict]:
    """A decode step's K/V come from memory, as in an engine stepping 30 layers: the calls
    rotate over copies of the cache that together exceed the last-level cache (1 GiB; one
    machine here has 480 MB of L3). A prompt's were just written, and are timed warm."""
    torch.set_num_threads(2)
    make = treadle_call if engine == "treadle" else vllm_call
    rows = []
    for d in dtypes:
        for n in lengths:
            copies = -(-(1 << 30) // kv_bytes(d, n, batch)) if batch else 1
            calls = [make(n, DTYPES[d], batch, block) for _ in range(copies)]
            rows.append({"engine": engine, "dtype": d, "tokens": n, "ms": 1e3 * median_call_s(calls)})
    return rows


def rate(dtype: str, tokens: int, ms: float, batch: int) -> str:
    """Prefill: causal attention's useful work (QK and PV over the lower triangle) in GFLOP/s.
    Decode: the K/V bytes read in GB/s, since decode attention is bound by memory."""
    if batch:
        return f"{kv_bytes(dtype, tokens, batch) / (ms * 1e6):.1f} GB/s"
    return f"{HEADS * tokens * tokens / 2 * HEAD_DIM * 4 / (ms * 1e6):.0f} GFLOP/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,288,512,1024")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--decode", type=int, default=0, metavar="B",
                        help="time a decode step of B sequences instead of one prompt")
    parser.add_argument("--block", type=int, default=16,
                        help="treadle's KV block size in tokens (vLLM's is its default, 128)")
    parser.add_argument("--engine", choices=("treadle", "vllm"),
                        help="time one engine's kernel here and print JSON (how the runner calls it)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    dtypes = args.dtypes.split(",")
    if args.engine:
        block = args.block if args.engine == "treadle" else 128
        print(json.dumps(measure(args.engine, lengths, dtypes, args.decode, block)))
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run   # the peers' locations and vLLM's environment

    rows = measure("treadle", lengths, dtypes, args.decode, args.block)
    vllm = subprocess.run([str(run.PEERS / "vllm/bin/python"), __file__, "--engine", "vllm",
                           "--lengths", args.lengths, "--dtypes", args.dtypes, "--decode", str(args.decode)],
                          env=run.vllm_env(), capture_output=True, text=True, cwd="/tmp")
    if vllm.returncode != 0:
        raise RuntimeError(f"vLLM's run failed:\n{vllm.stderr[-2000:]}")
    theirs = {(r["dtype"], r["tokens"]): r["ms"] for r in json.loads(vllm.stdout.splitlines()[-1])}
    print("| dtype | tokens | treadle ms/layer | vLLM ms/layer | treadle's time / vLLM's |")
    print("|---|---|---|---|---|")
    for r in rows:
        key, ours = (r["dtype"], r["tokens"]), r["ms"]
        print(f"| {r['dtype']} | {r['tokens']} | {ours:.3f} ({rate(*key, ours, args.decode)}) | "
              f"{theirs[key]:.3f} ({rate(*key, theirs[key], args.decode)}) | {ours / theirs[key]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
