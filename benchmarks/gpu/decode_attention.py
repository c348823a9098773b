"""Decode attention on a GPU: the unified kernel against the split-KV path, to set when decodes
split and into how many ranges (TritonBackend's split_max_decodes, split_min_tokens and
max_kv_splits, guesses until this has run; and whether decode CUDA graphs should split).

At Qwen3-0.6B's heads (16 query, 8 KV, 128 wide) in bf16 with 16-token blocks scattered over
the cache, for batches of 1-32 decodes and contexts of 256-4,096 keys: each split count's output
is checked against the unified kernel's, then every kernel is timed replayed in a CUDA graph
(what a decode step's graph pays). On the H200 attention took about 10 us a layer at batch 1
(docs/performance.md), a fifth of the step.

    python benchmarks/gpu/decode_attention.py --out DIR      # on the GPU (check.sh runs it)
    python benchmarks/gpu/decode_attention.py --device cpu --batches 1,2 --contexts 64 \\
        --splits 2 --out /tmp/a                              # a dry run here, interpreted

Writes DIR/decode_attention.json after every shape, and logs one line last: per batch, the
contexts where some split count beats the unified kernel, with the best count and its speed-up.
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
    for splits in ns.splits:
        kernels[f"split{splits}"] = functools.partial(split_kv_decode, torch.empty_like(q), q,
                                                      k_cache, v_cache, table, seq_lens, scale,
                                                      splits)
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
        timer = graphed_us if ns.device.type == "cuda" else time_us
        row[f"{name}_us"] = timer(kernel, ns.device, ns.reps)
    return row


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./gpu-results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,4,16,32", type=ints)
    # 1,000: a last tile that is partial, and a last block too.
    parser.add_argument("--contexts", default="256,1000,4096", type=ints)
    parser.add_argument("--splits", default="2,4,8,16", type=ints)
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
