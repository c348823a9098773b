"""treadle's offline API on one workload, in a process of its own (benchmarks/peers/run.py).

Reads {"model", "dtype", "prompts", "output_lens", "max_model_len"} as JSON from argv[1], writes
{"elapsed_s", "output_tokens", "token_ids"} to argv[2]. One untimed warm-up request first.
"""

import json
import sys
import time

from treadle import LLM, SamplingParams


def main() -> None:
    with open(sys.argv[1]) as f:
        work = json.load(f)
    llm = LLM(work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"],
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate({"prompt_token_ids": work["prompts"][0][:16]},
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    with open(sys.argv[2], "w") as f:
        json.dump({"elapsed_s": elapsed, "output_tokens": sum(map(len, token_ids)),
                   "token_ids": token_ids}, f)


if __name__ == "__main__":
    main()
