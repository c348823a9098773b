"""The host's time per step at a large batch: a model too small to cost anything (Qwen3's
architecture at hidden size 64), so that what a step costs is the engine's own Python and
numpy: scheduling, input preparation, sampling, output processing. On a GPU this is the time
the device waits for (docs/performance.md, "On a GPU": it sat idle 81-85% of decode steps).

    python benchmarks/host_step.py [--requests 256] [--tokens 64]
    python benchmarks/host_step.py --device cuda --shape qwen3-0.6b --backend triton [--async]
    python benchmarks/host_step.py --async --executor mp
    python benchmarks/host_step.py --throughput-shape   # the GPU check's throughput requests

Prints ms per step of the whole run, then the parts, each timed around its call. On a GPU,
`to_host` is the step's wait for its sampled tokens (deferred steps wait in `finish`), and
execute_model includes it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.gpu.workloads import (QWEN3_06B, TINY, build_model, random_prompts,  # noqa: E402
                                      throughput_prompts)
from treadle import LLM, SamplingParams  # noqa: E402
from treadle.core import kv_cache_manager, scheduler  # noqa: E402
from treadle.engine import output_processor  # noqa: E402
from treadle.worker import deferred_step, model_runner, sampler  # noqa: E402

PARTS = [(scheduler.Scheduler, "schedule"), (kv_cache_manager.KVCacheManager, "allocate_slots"),
         (model_runner.ModelRunner, "execute_model"), (model_runner.ModelRunner, "_forward"),
         (model_runner.ModelRunner, "_queue_samples"), (sampler.Sampler, "sample_slots"),
         (model_runner.ModelRunner, "_update_slots"), (model_runner.ModelRunner, "_verify"),
         (model_runner, "to_host"), (deferred_step.DeferredStep, "finish"),
         (scheduler.Scheduler, "update_from_output"),
         (output_processor.OutputProcessor, "process_outputs")]


def timed_parts() -> collections.Counter:
    """Wrap each part in a timer; returns the seconds each has taken so far."""
    seconds: collections.Counter = collections.Counter()
    for owner, name in PARTS:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start

        setattr(owner, name, timed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=["tiny", "qwen3-0.6b"], default="tiny")
    parser.add_argument("--backend", default="torch", help="attention_backend")
    parser.add_argument("--async", dest="async_scheduling", action="store_true")
    parser.add_argument("--executor", default="uni", choices=["uni", "mp"],
                        help="distributed_executor_backend; with mp the worker's parts run in its "
                             "process, untimed here")
    parser.add_argument("--throughput-shape", action="store_true",
                        help="256 requests, input and output lengths uniform in [100, 1024], as the "
                             "GPU check's throughput part; prints ms per 1,000 output tokens")
    ns = parser.parse_args()
    seconds = timed_parts()
    shape, dtype = (TINY, torch.float32) if ns.shape == "tiny" else (QWEN3_06B, torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        path = build_model("Qwen3", shape, folder, dtype)
        if ns.throughput_shape:
            prompts, lengths = throughput_prompts(shape["vocab_size"])
            ns.requests = len(prompts)
        else:
            prompts = random_prompts(ns.requests, (20, 40), shape["vocab_size"], seed=2)
            lengths = [ns.tokens] * ns.requests
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        with LLM(path, device=ns.device, dtype=str(dtype).removeprefix("torch."),
                 max_num_seqs=max(ns.requests, 8), attention_backend=ns.backend,
                 async_scheduling=ns.async_scheduling,
                 distributed_executor_backend=ns.executor) as llm:
            llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params[:8], use_tqdm=False)
            seconds.clear()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            wall = time.perf_counter() - start
    if ns.throughput_shape:
        per, unit = sum(lengths) / 1000, "ms per 1,000 output tokens"
        print(f"{ns.requests} requests, {sum(lengths)} output tokens in {wall:.2f} s: "
              f"{sum(lengths) / wall:.0f} tok/s, {wall / per * 1e3:.1f} {unit}")
    else:
        per, unit = ns.tokens, "ms per step"
        print(f"{ns.requests} requests x {ns.tokens} tokens: {wall / per * 1e3:.1f} {unit}")
    for name, s in seconds.most_common():
        print(f"  {name:20s} {s / per * 1e3:6.2f} {unit}")


if __name__ == "__main__":
    main()
