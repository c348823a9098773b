"""One decode step of B sequences at N tokens of context, in the engine: the median wall time of
`execute_model` over the last steps in which all B sequences decode, and nothing else.

    .venv/bin/python benchmarks/decode_step.py --batch 32 --context 300 [--dtype bfloat16]
        [--tile-rows 0]

--tile-rows overrides models/linear.py's TILE_ROWS, PAIR_ROWS and PANEL_ROWS (0: the AMX tile
kernel or the pairs kernel in bf16, or the AVX-512 panel kernel in fp32, serves no rows),
to compare a kernel path on and off in separate processes, taking turns. Time nothing else
while it runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from treadle import LLM, SamplingParams
from treadle.models import linear
from treadle.models.loader import prepare_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=300, help="prompt tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tile-rows", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8, help="decode steps to take the median of")
    ns = parser.parse_args()
    if ns.tile_rows is not None:
        # read when the model builds its layer stack
        linear.TILE_ROWS = linear.PAIR_ROWS = linear.PANEL_ROWS = ns.tile_rows
    llm = LLM(prepare_model(None), dtype=ns.dtype, enable_prefix_caching=False,
              max_model_len=ns.context + ns.steps + 64)
    executor = llm.engine.core.executor
    step_times: list[float] = []
    run_step = executor.execute_model

    def timed(so, *args, **kwargs):
        start = time.perf_counter()
        out = run_step(so, *args, **kwargs)
        if len(so.num_scheduled_tokens) == ns.batch == so.total_num_scheduled_tokens:
            step_times.append(time.perf_counter() - start)
        return out

    executor.execute_model = timed
    rng = np.random.default_rng(0)
    # Enough tokens that every sequence is decoding for the last `steps` steps, after the
    # prefill chunks of all B prompts.
    max_tokens = ns.steps + -(-ns.batch * ns.context // llm.engine.config.scheduler.max_num_batched_tokens) + 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(2):   # the first round warms up
        step_times.clear()
        prompts = [{"prompt_token_ids": rng.integers(100, 40000, ns.context).tolist()} for _ in range(ns.batch)]
        llm.generate(prompts, params, use_tqdm=False)
    last = step_times[-ns.steps:]
    print(f"{ns.dtype} batch {ns.batch} at {ns.context} tokens, TILE_ROWS {linear.TILE_ROWS}, "
          f"PAIR_ROWS {linear.PAIR_ROWS}, PANEL_ROWS {linear.PANEL_ROWS}: "
          f"decode step median {1000 * statistics.median(last):.1f} ms over {len(last)} steps")
    llm.shutdown()


if __name__ == "__main__":
    main()
