"""Decode attention on a GPU: the unified kernel against the split-KV path, to set when decodes
split and into how many ranges (TritonBackend's split_max_decodes, split_min_tokens and
max_kv_splits, guesses until this has run; and whether decode CUDA graphs should split).

At Qwen3-0.6B's heads (16 query, 8 KV, 128 wide) in bf16 with 16-token blocks scattered over
the cache, for batches of 1-32 decodes and contexts of 256-4,096 keys: each split count's output
is checked against the unified kernel's, then every kernel is timed replayed in a CUDA graph
(what a decode step's graph pays). On the H200 attention took about 10 us a layer at batch 1
(docs/performance.md), a fifth of the step.

At the throughput workload's batch (256 decodes; no split there), what matters is how near the
unified kernel reads the cache at the device's bandwidth: each row has the kernel's GB/s (KV
bytes read over its time), beside what a device-to-device copy moves in the same run (bytes read
and written over its time: twice what it copies). At 256 decodes of about 1,000 keys, Qwen3-0.6B
reads about 29 GB of KV a step over its 28 layers: attention, not the weights, bounds the step.
There the unified kernel is also timed in other shapes (`UNIFIED_VARIANTS`: the loop's, keys per
tile, warps, pipeline stages), each checked against the default's output, to choose its default.

    python benchmarks/gpu/decode_attention.py --out DIR      # on the GPU (check.sh runs it)
    python benchmarks/gpu/decode_attention.py --device cpu --batches 40,1 --contexts 64 \\
        --splits 2 --out /tmp/a                              # a dry run here, interpreted

Writes DIR/decode_attention.json after every shape, and logs two lines last: per batch, the
contexts where some split count beats the unified kernel, with the best count and its speed-up;
then the unified kernel's GB/s at the largest batch against what the copy moves.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.gpu.fused_ops import graphed_us, time_us  # noqa: E402

logger = logging.getLogger("decode_attention")

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
# Past --max-split-batch (32: TritonBackend.split_max_decodes is a guess at most that) no split
# count is timed, only the unified kernel, in its default launch shape and these.
# The loop loads each tile's cache blocks a tile ahead (triton_unified.next_tile_blocks): compiled
# for sm_90 (Triton 3.6 and 3.9, here), the default 3 stages then keep two K/V buffers in shared
# memory, where loading them in the tile itself left one. That old loop is the first variant.
UNIFIED_VARIANTS = {"unified_same_tile_blocks": {"blocks_ahead": False},
                    "unified_tile64": {"tile_n": 64}, "unified_warps8": {"num_warps": 8},
                    "unified_stages4": {"num_stages": 4}}
# A split's output further than this from unified's, relative to unified's largest value, is
# wrong, not rounded: outputs over thousands of keys are small, so an absolute bound would pass
# a range left out.
MAX_ERR = 2e-2


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def inputs(batch: int, context: int, device: torch.device, dtype: torch.dtype):
    """q for `batch` one-token decodes, each with `context` keys in blocks scattered over a
    cache of exactly that many blocks, and the kernels' metadata."""
    gen = torch.Generator(device).manual_seed(batch * 100003 + context)   # made there: no copy
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1   # block 0: the null block, as the engine's
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device=device,
                        dtype=dtype)
    table = (torch.randperm(num_blocks - 1, generator=gen, device=device)[:batch * blocks_per_seq] + 1)
    table = table.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, cache[0], cache[1], table, seq_lens, query_start


def run_shape(batch: int, context: int, ns: argparse.Namespace) -> dict[str, Any]:
    from treadle.attention.triton_decode import split_kv_decode
    from treadle.attention.triton_unified import unified_attention

    q, k_cache, v_cache, table, seq_lens, query_start = inputs(batch, context, ns.device, ns.dtype)
    scale = HEAD_DIM ** -0.5
    kernels = {"unified": functools.partial(unified_attention, torch.empty_like(q), q, k_cache,
                                            v_cache, table, seq_lens, query_start, scale)}
    for splits in ns.splits if batch <= ns.max_split_batch else ():
        kernels[f"split{splits}"] = functools.partial(split_kv_decode, torch.empty_like(q), q,
                                                      k_cache, v_cache, table, seq_lens, scale,
                                                      splits)
    for name, launch in UNIFIED_VARIANTS.items() if batch > ns.max_split_batch else ():
        kernels[name] = functools.partial(unified_attention, torch.empty_like(q), q, k_cache,
                                          v_cache, table, seq_lens, query_start, scale, **launch)
    want = kernels["unified"].args[0]
    kernels["unified"]()
    row: dict[str, Any] = {}
    for name, kernel in kernels.items():
        if name != "unified":
            kernel()
            got = kernel.args[0]
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if err > MAX_ERR:
                raise ValueError(f"{name} at batch {batch}, context {context}: {err:.3g} from unified")
        row[f"{name}_us"] = timer(ns)(kernel, ns.device, ns.reps)
        if name.startswith("unified"):
            row[f"{name}_gbs"] = kv_bytes(batch, context, ns.dtype) / row[f"{name}_us"] / 1e3
    return row


def timer(ns: argparse.Namespace):
    """Replayed in a CUDA graph on a GPU (what a decode step's graph pays); launched here."""
    return graphed_us if ns.device.type == "cuda" else time_us


def kv_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    """The K and V bytes `batch` decodes of `context` keys read in one layer."""
    return 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize


def copy_gbs(ns: argparse.Namespace) -> float:
    """A device-to-device copy of 1 GiB (64 MiB on the CPU), in GB moved a second: each byte
    is read and written, so twice what it copies, on the scale of the kernel's reads."""
    size = 2 ** 30 if ns.device.type == "cuda" else 2 ** 26
    src = torch.empty(size, dtype=torch.uint8, device=ns.device)
    dst = torch.empty_like(src)
    return 2 * size / timer(ns)(lambda: dst.copy_(src), ns.device, ns.reps) / 1e3


def summary(shapes: dict[str, dict[str, Any]]) -> str:
    """Per batch: where the best split beats unified, `context: splitS x speed-up`."""
    by_batch: dict[str, list[str]] = {}
    for key, row in shapes.items():
        batch, context = key.split("x")
        if "error" in row:
            by_batch.setdefault(batch, []).append(f"{context}: FAILED")
            continue
        best = min((n for n in row if n.startswith("split")), key=row.get, default=None)
        if best is not None and row[best] < row["unified_us"]:
            by_batch.setdefault(batch, []).append(
                f"{context}: {best.removesuffix('_us')} {row['unified_us'] / row[best]:.2f}x")
        else:
            by_batch.setdefault(batch, []).append(f"{context}: unified")
    return "; ".join(f"batch {b}: " + ", ".join(v) for b, v in by_batch.items())


def bandwidth_summary(shapes: dict[str, dict[str, Any]], copy: float) -> str:
    """The unified kernel's GB/s at the largest batch, per context, in its default launch shape
    and its fastest, against the copy's."""
    largest = max(int(key.split("x")[0]) for key in shapes)
    rows = []
    for key, row in shapes.items():
        if key.startswith(f"{largest}x") and "error" not in row:
            best = max((n for n in row if n.endswith("_gbs")), key=row.get)
            rows.append(f"{key.split('x')[1]} keys {row['unified_gbs']:.0f} GB/s (fastest: "
                        f"{best.removesuffix('_gbs')}, {row[best]:.0f})")
    return f"batch {largest}: " + ", ".join(rows) + f"; a copy moves {copy:.0f} GB/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./gpu-results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    # The throughput workload's batch first: its compiles differ from the others', and the
    # check's limit, if reached, cuts the small batches' split counts instead.
    parser.add_argument("--batches", default="256,1,4,16,32", type=ints)
    # 1,000: a last tile that is partial, and a last block too.
    parser.add_argument("--contexts", default="256,1000,4096", type=ints)
    parser.add_argument("--splits", default="2,4,8,16", type=ints)
    parser.add_argument("--max-split-batch", type=int, default=32,
                        help="the largest batch whose split counts are timed; past it, the "
                             "unified kernel's launch shapes")
    parser.add_argument("--reps", type=int, default=20, help="calls per timed round")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ns.device, ns.dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    if ns.device.type == "cpu":   # before the kernels are imported: they are defined then
        os.environ["TRITON_INTERPRET"] = "1"
    os.makedirs(ns.out, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(ns.device) if ns.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(ns.dtype), "block_size": BLOCK,
        "heads": {"q": Q_HEADS, "kv": KV_HEADS, "dim": HEAD_DIM},
        "timing": "replayed in a CUDA graph" if ns.device.type == "cuda" else "launched",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shapes": {}}
    failed = False
    with torch.inference_mode():
        report["copy_moves_gbs"] = copy_gbs(ns)   # first: the limit may stop the shapes part way
        for batch in ns.batches:
            for context in ns.contexts:
                key = f"{batch}x{context}"
                try:
                    report["shapes"][key] = run_shape(batch, context, ns)
                except Exception as exc:   # one shape's failure must not hide the others
                    logger.exception("batch %d, context %d failed", batch, context)
                    report["shapes"][key] = {"error": repr(exc)[:300]}
                    failed = True
                logger.info("batch %d, context %d: %s", batch, context, report["shapes"][key])
                with open(os.path.join(ns.out, "decode_attention.json"), "w") as f:
                    json.dump(report, f, indent=2)
    logger.info("split-KV against unified (%s, %s): %s", report["timing"], ns.dtype,
                summary(report["shapes"]))
    logger.info("unified kernel's reads: %s", bandwidth_summary(report["shapes"], report["copy_moves_gbs"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
