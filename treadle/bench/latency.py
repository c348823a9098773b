"""End-to-end latency of one batch: `batch_size` prompts of `input_len` random ordinary tokens,
each generating exactly `output_len` tokens (greedy, ignore_eos), timed over several iterations.
Each iteration draws fresh prompts (seeded), so the prefix cache never shortens a prefill.
With --compare-async, sync and async scheduling run in the same process, iterations
interleaved (sync, async, sync, ...) so that machine noise falls on both alike."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import numpy as np

from treadle.bench.throughput import check_at_least, machine, make_workload

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens [default: 32]")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens [default: 128]")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per batch [default: 8]")
    g.add_argument("--num-iters", type=int, default=5, help="timed iterations [default: 5]")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations [default: 1]")
    g = parser.add_argument_group("comparison and output")
    g.add_argument("--compare-async", action="store_true",
                   help="time sync and async scheduling in the same run (ignores --async-scheduling)")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


def summarize(latencies: list[float]) -> dict[str, float]:
    a = np.asarray(latencies)
    return {"mean_s": float(a.mean()), "median_s": float(np.median(a)),
            "p90_s": float(np.percentile(a, 90)), "p99_s": float(np.percentile(a, 99)),
            "min_s": float(a.min()), "iters": len(latencies)}


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM, SamplingParams
    from treadle.entrypoints.engine_cli_args import engine_args_from

    check_at_least(ns, input_len=1, output_len=1, batch_size=1, num_iters=1, num_iters_warmup=0)
    engine_args = engine_args_from(ns)
    seed = engine_args.get("seed") or 0
    host = machine()
    if ns.compare_async:
        engines = {mode: LLM(**(engine_args | {"async_scheduling": mode})) for mode in (False, True)}
    else:   # as set, or the device's default
        llm = LLM(**engine_args)
        engines = {llm.engine.config.scheduler.async_scheduling: llm}
    modes = list(engines)
    tokenizer = next(iter(engines.values())).get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    latencies: dict[bool, list[float]] = {m: [] for m in modes}
    for it in range(ns.num_iters_warmup + ns.num_iters):
        work = make_workload(tokenizer, ns.batch_size, (ns.input_len,) * 2, (ns.output_len,) * 2, seed + it)
        prompts = [{"prompt_token_ids": p} for p in work.prompts]
        for mode in modes:
            start = time.perf_counter()
            engines[mode].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if it >= ns.num_iters_warmup:
                latencies[mode].append(elapsed)
                logger.info("iteration %d, async=%s: %.3f s", it, mode, elapsed)

    report: dict[str, Any] = {
        "command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
        "workload": {"batch_size": ns.batch_size, "input_len": ns.input_len,
                     "output_len": ns.output_len, "num_iters": ns.num_iters,
                     "num_iters_warmup": ns.num_iters_warmup, "seed": seed},
        "engine_args": engine_args,
        "results": {("async" if m else "sync"): summarize(latencies[m]) for m in modes},
    }
    out = sys.stdout
    out.write(f"batch {ns.batch_size} x ({ns.input_len} in, {ns.output_len} out), "
              f"{ns.num_iters} timed iterations; {host['cpu']}, {host['cores']} cores, "
              f"torch {host['torch']} ({host['torch_threads']} threads)\n\n")
    out.write("| scheduling | mean s | median s | p90 s | p99 s | ms per output token step |\n"
              "|---|---|---|---|---|---|\n")
    for name, r in report["results"].items():
        out.write(f"| {name} | {r['mean_s']:.3f} | {r['median_s']:.3f} | {r['p90_s']:.3f} | "
                  f"{r['p99_s']:.3f} | {1000 * r['median_s'] / ns.output_len:.1f} |\n")
    if ns.compare_async:
        ratio = report["results"]["sync"]["median_s"] / report["results"]["async"]["median_s"]
        report["speedup_async_over_sync_median"] = ratio
        out.write(f"\nasync speed-up over sync (median latency): {ratio:.3f}x\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
