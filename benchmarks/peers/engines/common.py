"""What every offline driver does around its engine: read the workload, warm up, time the batch,
write the result. Plain Python, so each engine's own interpreter can import it."""

import json
import sys
import time
from typing import Callable

# generate(prompts, output_lens) -> token ids per request
Generate = Callable[[list[list[int]], list[int]], list[list[int]]]


def load_spec() -> dict:
    """{"model", "dtype", "prompts", "output_lens", "max_model_len"}, from the JSON at argv[1]."""
    with open(sys.argv[1]) as f:
        return json.load(f)


def run(spec: dict, generate: Generate) -> None:
    """One untimed warm-up request, then the timed batch; writes {"elapsed_s",
    "output_tokens", "token_ids"} to argv[2]."""
    generate([spec["prompts"][0][:16]], [4])
    start = time.perf_counter()
    token_ids = generate(spec["prompts"], spec["output_lens"])
    elapsed = time.perf_counter() - start
    with open(sys.argv[2], "w") as f:
        json.dump({"elapsed_s": elapsed, "output_tokens": sum(map(len, token_ids)),
                   "token_ids": token_ids}, f)
