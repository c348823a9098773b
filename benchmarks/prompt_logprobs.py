"""One 512-token prompt with prompt_logprobs=5 through the embedded model, in chunks of 512:
the median of 5 timed runs after a warm-up, in ms (the prefill, the head over every prompt
position, and the logprobs of each).

    .venv/bin/python benchmarks/prompt_logprobs.py
"""

from __future__ import annotations

import statistics
import time

import torch

from treadle import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_num_batched_tokens=512)
    ids = torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)   # warm-up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    print(f"{statistics.median(times) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
