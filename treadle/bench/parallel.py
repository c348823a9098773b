"""Worker processes on this host: what the `mp` executor costs per step, and what pipeline
stages do for long prefills.

1. Step overhead at world size 1: the same decode workload (--decode-batch requests of
   --decode-tokens tokens) on `uni` (the worker in this process) and `mp` (one worker
   process with the same threads). The overhead of a step is the engine's time per step less
   the time the worker spent running it (what the two runs' step times differ by is mostly
   noise on a shared machine); also the bare round trip of a call that does nothing.
2. Prefill throughput: --num-prompts prompts of --prompt-len random tokens, max_tokens=1,
   chunked by --max-num-batched-tokens, on one stage (`uni`, every core) and on --pp stages
   (`mp`, the cores shared out among them). Both runs' tokens are compared.
Prefix caching is off, so every prompt token is computed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from treadle.bench.throughput import check_at_least, machine, make_workload


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--prompt-len", type=int, default=2048, help="tokens per long prompt [default: 2048]")
    g.add_argument("--num-prompts", type=int, default=4, help="long prompts [default: 4]")
    g.add_argument("--pp", type=int, default=2, help="pipeline stages to compare with one [default: 2]")
    g.add_argument("--decode-batch", type=int, default=8, help="requests in the decode run [default: 8]")
    g.add_argument("--decode-tokens", type=int, default=64, help="tokens each decodes [default: 64]")
    g.add_argument("--rpc-calls", type=int, default=300, help="no-op round trips timed [default: 300]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


def _count_steps(llm: Any) -> list[int]:
    """Counts the steps the engine sends to its executor from now on."""
    count = [0]
    executor = llm.engine.core.executor
    execute = executor.execute_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return execute(*args, **kwargs)

    executor.execute_model = counted
    return count


def _noop(worker: Any) -> None:
    """A call that does nothing in the worker: its time is the RPC's."""


def _time_steps(worker: Any) -> None:
    """From now on, add up the time the worker spends running steps (in `busy_s`)."""
    run = worker.runner.execute_model
    worker.busy_s = 0.0

    def timed(scheduler_output: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(scheduler_output)
        finally:
            worker.busy_s += time.perf_counter() - start

    worker.runner.execute_model = timed


def _busy_s(worker: Any) -> float:
    return worker.busy_s


def step_overhead(engine_args: dict[str, Any], ns: argparse.Namespace) -> dict[str, Any]:
    from treadle import LLM, SamplingParams

    out: dict[str, Any] = {}
    for backend in ("uni", "mp"):
        with LLM(**engine_args, distributed_executor_backend=backend) as llm:
            work = make_workload(llm.get_tokenizer(), ns.decode_batch, (32, 32), (1, 1), 0)
            params = SamplingParams(temperature=0.0, max_tokens=ns.decode_tokens, ignore_eos=True)
            prompts = [{"prompt_token_ids": p} for p in work.prompts]
            llm.generate(prompts, params, use_tqdm=False)   # warm-up
            llm.collective_rpc(_time_steps)
            steps = _count_steps(llm)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            busy = llm.collective_rpc(_busy_s)[0]
            start = time.perf_counter()
            for _ in range(ns.rpc_calls):
                llm.collective_rpc(_noop)
            rpc_s = (time.perf_counter() - start) / ns.rpc_calls
        out[backend] = {"steps": steps[0], "elapsed_s": elapsed,
                        "step_ms": 1e3 * elapsed / steps[0],
                        "worker_ms": 1e3 * busy / steps[0],
                        "overhead_ms": 1e3 * (elapsed - busy) / steps[0],
                        "noop_call_us": 1e6 * rpc_s}
    return out


def prefill(engine_args: dict[str, Any], ns: argparse.Namespace) -> dict[str, Any]:
    from treadle import LLM, SamplingParams

    out: dict[str, Any] = {}
    tokens: dict[str, list] = {}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for name, args in (("pp=1", {}), (f"pp={ns.pp}", {"pipeline_parallel_size": ns.pp})):
        with LLM(**engine_args, **args) as llm:
            tok = llm.get_tokenizer()
            warm = make_workload(tok, 1, (ns.prompt_len,) * 2, (1, 1), 1).prompts
            work = make_workload(tok, ns.num_prompts, (ns.prompt_len,) * 2, (1, 1), 0).prompts
            llm.generate([{"prompt_token_ids": p} for p in warm], one, use_tqdm=False)
            llm.collective_rpc(_time_steps)
            steps = _count_steps(llm)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in work], one, use_tqdm=False)
            elapsed = time.perf_counter() - start
            busy = llm.collective_rpc(_busy_s)
            waits = [s["recv_wait_s"] for s in llm.collective_rpc("pipeline_stats")]
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        # Per stage: the time its worker spent computing steps (waits for other stages out).
        out[name] = {"elapsed_s": elapsed, "steps": steps[0],
                     "stage_compute_s": [b - w for b, w in zip(busy, waits)],
                     "stage_wait_s": waits,
                     "prompt_tok_s": ns.num_prompts * ns.prompt_len / elapsed}
    names = list(out)
    out["speedup"] = out[names[1]]["prompt_tok_s"] / out[names[0]]["prompt_tok_s"]
    out["tokens_agree"] = tokens[names[0]] == tokens[names[1]]
    return out


def main(ns: argparse.Namespace) -> int:
    from treadle.entrypoints.engine_cli_args import engine_args_from

    check_at_least(ns, prompt_len=1, num_prompts=1, decode_batch=1, decode_tokens=1, rpc_calls=1,
                   pp=2)
    engine_args = engine_args_from(ns) | {"enable_prefix_caching": False}
    for key in ("pipeline_parallel_size", "tensor_parallel_size", "distributed_executor_backend"):
        engine_args.pop(key, None)   # this bench sets them
    if engine_args.get("max_model_len") is None:
        engine_args["max_model_len"] = ns.prompt_len + 16
    if engine_args.get("max_num_batched_tokens") is None:
        engine_args["max_num_batched_tokens"] = 512

    overhead = step_overhead(engine_args, ns)
    pipeline = prefill(engine_args, ns)
    host = machine()
    report = {"command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
              "engine_args": engine_args, "step_overhead": overhead, "prefill": pipeline}
    w = sys.stdout.write
    w(f"{host['cpu']}, {host['cores']} cores, torch {host['torch']}\n\n"
      f"Step overhead at world size 1 ({ns.decode_batch} requests x {ns.decode_tokens} tokens):\n\n"
      "| executor | steps | ms per step | in the worker | overhead ms | no-op call us |\n"
      "|---|---|---|---|---|---|\n")
    for backend in ("uni", "mp"):
        r = overhead[backend]
        w(f"| {backend} | {r['steps']} | {r['step_ms']:.2f} | {r['worker_ms']:.2f} | "
          f"{r['overhead_ms']:.2f} | {r['noop_call_us']:.0f} |\n")
    w("\n"
      f"Prefill of {ns.num_prompts} x {ns.prompt_len} tokens in chunks of "
      f"{engine_args['max_num_batched_tokens']}:\n\n"
      "| stages | steps | s | prompt tok/s | compute s per stage | waiting s per stage |\n"
      "|---|---|---|---|---|---|\n")
    for name in [k for k in pipeline if k.startswith("pp=")]:
        r = pipeline[name]
        compute = ", ".join(f"{b:.2f}" for b in r["stage_compute_s"])
        waits = ", ".join(f"{b:.2f}" for b in r["stage_wait_s"])
        w(f"| {name} | {r['steps']} | {r['elapsed_s']:.2f} | {r['prompt_tok_s']:.0f} | "
          f"{compute} | {waits} |\n")
    w(f"\npp={ns.pp} / pp=1: {pipeline['speedup']:.2f}x; first tokens agree: "
      f"{pipeline['tokens_agree']}\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
