"""Batch-1 decode against the memory-bandwidth floor.

A decode step at batch 1 must read every weight it multiplies by once, so it can be no faster
than (weight bytes read per step) / (memory bandwidth). This measures both on this machine and
reports the ratio of the measured time per output token to that floor:
  - bandwidth: a large tensor copy (`--copy-mib`, well past the caches) on torch's threads,
    counted as STREAM's copy counts it, bytes read plus bytes written (a GEMV streaming weights
    can read faster than that, so the floor is a conservative yardstick, not a hard limit),
    measured beside each timed iteration and taken as the median;
  - weight bytes per step: every parameter the step reads in full (the embedding table only when
    it is also the output head, since a lookup reads one row);
  - TPOT: one prompt of --input-len tokens generating --output-len tokens and then 1 token; the
    difference over output_len - 1 steps is the time per output token without the prefill.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import numpy as np
import torch

from treadle.bench.throughput import check_at_least, machine, make_workload

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens [default: 32]")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens [default: 128]")
    g.add_argument("--num-iters", type=int, default=5, help="timed iterations [default: 5]")
    g.add_argument("--copy-mib", type=int, default=1024,
                   help="size of the bandwidth copy, MiB [default: 1024]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


def copy_bandwidth(mib: int, iters: int = 10) -> float:
    """Bytes per second of a large copy (read + write), the median of `iters` (the best one
    varied by 1.6x between runs here)."""
    numel = mib * 2 ** 20 // 4
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)   # touch every page first
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / float(np.median(times))


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads in full: all of them, except an embedding
    table that is not also the output head (a lookup reads one row per token). A weight with
    a weight-only copy (int8, GGUF blocks) counts that copy, which is what batch-1 decode reads."""
    embed = model.model.embed_tokens
    skip = embed.weight if embed is not None and not model.tie_word_embeddings else None
    copies = model.quantized_copies()
    total = 0
    for p in model.parameters():
        if p is skip:
            continue
        copy = copies.get(id(p))
        total += (sum(t.numel() * t.element_size() for t in copy.tensors) if copy is not None
                  else p.numel() * p.element_size())
    return total


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM, SamplingParams
    from treadle.entrypoints.engine_cli_args import engine_args_from

    check_at_least(ns, input_len=1, output_len=2, num_iters=1, copy_mib=64)
    engine_args = engine_args_from(ns)
    llm = LLM(**engine_args)
    model = llm.engine.core.executor.worker.runner.model
    weight_bytes = weight_bytes_per_step(model)

    def latency(output_len: int, seed: int) -> float:
        work = make_workload(llm.get_tokenizer(), 1, (ns.input_len,) * 2, (output_len,) * 2, seed)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": work.prompts[0]}], params, use_tqdm=False)
        return time.perf_counter() - start

    latency(ns.output_len, 10_000)   # warm-up
    tpots, longs, shorts, bandwidths = [], [], [], []
    for it in range(ns.num_iters):
        # Beside each timing: this machine's bandwidth moved between 32 and 55 GB/s within
        # minutes, and a floor measured once, apart from the decode, compares two moments.
        bandwidths.append(copy_bandwidth(ns.copy_mib, iters=3))
        longs.append(latency(ns.output_len, it))
        shorts.append(latency(1, it))
        tpots.append((longs[-1] - shorts[-1]) / (ns.output_len - 1))
    # Medians of each length, not of the differences: one slow short run (a hiccup of a few
    # ms) cannot then swing a tiny model's TPOT below zero.
    tpot = float(np.median(longs) - np.median(shorts)) / (ns.output_len - 1)
    bandwidth = float(np.median(bandwidths))
    floor = weight_bytes / bandwidth
    host = machine()
    report: dict[str, Any] = {
        "command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
        "engine_args": engine_args, "dtype": str(llm.engine.config.model.dtype).removeprefix("torch."),
        "weight_bytes_per_step": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
        "copy_bandwidth_gb_s_all": [b / 1e9 for b in bandwidths],
        "floor_ms": 1000 * floor, "tpot_ms_median": 1000 * tpot,
        "tpot_ms_all": [1000 * t for t in tpots], "tpot_over_floor": tpot / floor,
    }
    llm.shutdown()
    sys.stdout.write(
        f"batch 1, {ns.input_len} prompt tokens, {ns.output_len} output tokens, {report['dtype']}; "
        f"{host['cpu']}, {host['cores']} cores, torch {host['torch']} ({host['torch_threads']} threads)\n"
        f"weights read per step {weight_bytes / 2 ** 20:.1f} MiB, copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s -> floor {1000 * floor:.1f} ms\n"
        f"TPOT median {1000 * tpot:.1f} ms ({tpot / floor:.2f}x the floor)\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
