"""Time to first token in process: treadle's offline API against vLLM-CPU's, one prompt at a
time, with no server in between. Each prompt (random token ids, a fresh draw for every
repetition, prefix caching off) asks for one output token, so its time is the prefill step
and the engine's own overhead. Per prompt length: the median, the minimum and the mean of the
faster half over --reps repetitions, in ms.

With --batch B, each repetition sends B prompts of that length at once, as the first wave of a
serving level does, and times the last first token: B x length tokens of prefill in steps of
--max-num-batched-tokens (2,048, as both servers default to on CPU).

    .venv/bin/python benchmarks/peers/ttft.py [--lengths 64,288,512] [--dtype bf16] [--rounds 2]
        [--batch 32 --reps 5]

The engines take turns, --rounds times each, every run in a process of its own: treadle's in
this interpreter, vLLM's in its virtual environment (setup.sh) with the environment run.py gives
it. Both load the embedded model's HF folder. Time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def measure(generate: Callable[[list[list[int]]], None], lengths: list[int], reps: int,
            batch: int) -> dict[int, list[float]]:
    """{tokens: [median, min, mean of the faster half]} in ms, after three warm-up batches."""
    for i in range(3):
        generate([prompt(64, 10_000 + 100 * i + b) for b in range(batch)])
    result = {}
    for n in lengths:
        times = []
        for r in range(reps):
            prompts = [prompt(n, (n * 1000 + r) * 1000 + b) for b in range(batch)]
            start = time.perf_counter()
            generate(prompts)
            times.append(1e3 * (time.perf_counter() - start))
        times.sort()
        result[n] = [statistics.median(times), times[0], statistics.mean(times[:(reps + 1) // 2])]
    return result


def engine_generate(engine: str, model: str, dtype: str,
                    max_batched: int) -> Callable[[list[list[int]]], None]:
    common = dict(dtype=dtype, max_model_len=2048, seed=0, enable_prefix_caching=False,
                  max_num_batched_tokens=max_batched)
    if engine == "treadle":
        from treadle import LLM, SamplingParams
        llm = LLM(model, **common)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        return lambda prompts: llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                                            use_tqdm=False)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=model, **common)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                                        params, use_tqdm=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,288,512")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts sent at once [default: 1]")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--engine", choices=("treadle", "vllm"),
                        help="time one engine here and print JSON (how the runner calls it)")
    parser.add_argument("--model", help="the HF folder (the runner passes the embedded model's)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.engine:
        generate = engine_generate(args.engine, args.model, DTYPES[args.dtype],
                                   args.max_num_batched_tokens)
        print(json.dumps(measure(generate, lengths, args.reps, args.batch)))
        return 0

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import run   # the peers' locations and vLLM's environment
    from treadle.models.loader import prepare_model

    model = prepare_model(None)
    common = ["--engine", "", "--model", model, "--lengths", args.lengths, "--dtype", args.dtype,
              "--reps", str(args.reps), "--batch", str(args.batch),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    runs = {"treadle": (sys.executable, None), "vllm": (str(run.PEERS / "vllm/bin/python"), run.vllm_env())}
    print("| round | engine | " + " | ".join(f"{n} tokens: median / min / faster half" for n in lengths) + " |")
    print("|---" * (2 + len(lengths)) + "|")
    for rnd in range(1, args.rounds + 1):
        for engine, (python, env) in runs.items():
            common[1] = engine
            done = subprocess.run([python, __file__, *common], env=env, capture_output=True, text=True, cwd="/tmp")
            if done.returncode != 0:
                raise RuntimeError(f"{engine}'s run failed:\n{done.stderr[-2000:]}")
            ms = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
            cells = " | ".join("{:.1f} / {:.1f} / {:.1f}".format(*ms[str(n)]) for n in lengths)
            print(f"| {rnd} | {engine} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
