"""Batch-1 decode at a long context: treadle's offline engine against vLLM-CPU's and
llama.cpp's server. One prompt of N random tokens generates 48 tokens. treadle and vLLM run in
process, a step timed around the engine's own `step()`, and a repetition's figure is the
median step after the first eight (the prefill and the first decodes left out); llama-server
(one slot of 8,192 tokens) reports its own mean time per generated token. Per context
length: the median of the repetitions' figures, in ms.

    .venv/bin/python benchmarks/peers/long_decode.py [--lengths 1500,4000,7000] [--dtype bf16]

The engines take turns, --rounds times each, every run in a process of its own, as in ttft.py:
treadle's in this interpreter, vLLM's in its virtual environment (setup.sh) with the
environment run.py gives it, llama-server on the GGUF run.py writes. treadle and vLLM load
the embedded model's HF folder, with prefix caching off. Time nothing else while it runs.
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
from typing import Any, Callable

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
MAX_LEN = 8192


def engine_steps(engine: str, model: str, dtype: str) -> Callable[[list[int], int], list[float]]:
    """A function that runs one request of these prompt ids for n tokens, step by step, and
    returns each step's seconds."""
    if engine == "treadle":
        from treadle import LLM, SamplingParams
        llm = LLM(model, dtype=dtype, max_model_len=MAX_LEN, seed=0, enable_prefix_caching=False)
        core: Any = llm.engine
        prompt = lambda ids: {"prompt_token_ids": ids}   # noqa: E731
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=model, dtype=dtype, max_model_len=MAX_LEN, seed=0, enable_prefix_caching=False)
        core = llm.llm_engine
        prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)   # noqa: E731

    def run(ids: list[int], n: int) -> list[float]:
        core.add_request(f"r{time.monotonic_ns()}", prompt(ids),
                         SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        times = []
        while core.has_unfinished_requests():
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        return times
    return run


def measure(run: Callable[[list[int], int], list[float]], lengths: list[int], reps: int) -> dict[int, float]:
    run([random.Random(-1).randrange(100, 40000) for _ in range(64)], 16)   # warm-up
    result = {}
    for n in lengths:
        per_rep = []
        for r in range(reps):
            rng = random.Random(n * 1000 + r)
            times = run([rng.randrange(100, 40000) for _ in range(n)], 48)
            per_rep.append(1e3 * statistics.median(times[8:]))
        result[n] = statistics.median(per_rep)
    return result


def llama_cpp(run_mod: Any, dtype: str, lengths: list[int], reps: int) -> dict[int, float]:
    """llama-server's own time per generated token (`timings.predicted_per_token_ms`)."""
    import urllib.request

    port = run_mod.free_port()
    cmd = [run_mod.llama_bin("llama-server"), "-m", run_mod.gguf_weights()[dtype], "--port", str(port),
           "-np", "1", "-c", str(MAX_LEN), "-t", "2", "-tb", "2", "--cache-ram", "0"]
    server = subprocess.Popen(cmd, env=run_mod.llama_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def one(ids: list[int]) -> float:
        body = json.dumps({"prompt": ids, "n_predict": 48, "ignore_eos": True, "cache_prompt": False,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as resp:
            return json.loads(resp.read())["timings"]["predicted_per_token_ms"]
    try:
        run_mod.wait_healthy(f"http://127.0.0.1:{port}", server)
        one([random.Random(-1).randrange(100, 40000) for _ in range(64)])   # warm-up
        result = {}
        for n in lengths:
            per_rep = []
            for r in range(reps):
                rng = random.Random(n * 1000 + r)
                per_rep.append(one([rng.randrange(100, 40000) for _ in range(n)]))
            result[n] = statistics.median(per_rep)
        return result
    finally:
        run_mod.stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1500,4000,7000")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="treadle,vllm,llamacpp")
    parser.add_argument("--engine", choices=("treadle", "vllm"),
                        help="time one engine here and print JSON (how the runner calls it)")
    parser.add_argument("--model", help="the HF folder (the runner passes the embedded model's)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(not 0 < n <= MAX_LEN - 48 for n in lengths):
        parser.error(f"--lengths: each in 1..{MAX_LEN - 48}")
    if args.engine:
        print(json.dumps(measure(engine_steps(args.engine, args.model, DTYPES[args.dtype]), lengths, args.reps)))
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run   # the peers' locations and vLLM's environment
    from treadle.models.loader import prepare_model

    model = prepare_model(None)
    pythons = {"treadle": (sys.executable, None), "vllm": (str(run.PEERS / "vllm/bin/python"), run.vllm_env())}
    print("| round | engine | " + " | ".join(f"{n} tokens: ms per step" for n in lengths) + " |")
    print("|---" * (2 + len(lengths)) + "|")
    for rnd in range(1, args.rounds + 1):
        for engine in args.engines.split(","):
            if engine == "llamacpp":
                ms = {str(n): v for n, v in llama_cpp(run, args.dtype, lengths, args.reps).items()}
                print(f"| {rnd} | llama.cpp | " + " | ".join(f"{ms[str(n)]:.1f}" for n in lengths) + " |",
                      flush=True)
                continue
            python, env = pythons[engine]
            cmd = [python, __file__, "--engine", engine, "--model", model, "--lengths", args.lengths,
                   "--dtype", args.dtype, "--reps", str(args.reps)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp")
            if done.returncode != 0:
                raise RuntimeError(f"{engine}'s run failed:\n{done.stderr[-2000:]}")
            ms = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
            print(f"| {rnd} | {engine} | " + " | ".join(f"{ms[str(n)]:.1f}" for n in lengths) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
