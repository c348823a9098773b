"""The cost of structured outputs. Decode time per step with a JSON-schema constraint against
the same decode unconstrained, at each batch size; and the compile time of a medium schema,
cold (a fresh compiler) and cached.

Every request decodes exactly --output-len tokens: the constrained schema is a list of at least
1000 medium objects, which no output finishes before max_tokens, and the free run uses
ignore_eos. Runs alternate (free, constrained, free, ...) so machine noise falls on both."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from treadle.bench.throughput import check_at_least, machine, make_workload

MEDIUM_SCHEMA = {
    "type": "object",
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "address"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {"type": "object", "required": ["city", "country"], "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["FR", "DE", "US", "JP"]}}},
        "manager": {"type": ["integer", "null"]},
    },
}
LONG_LIST = {"type": "array", "minItems": 1000, "items": MEDIUM_SCHEMA}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--batch-sizes", default="1,32", help="comma-separated [default: 1,32]")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens [default: 32]")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens [default: 128]")
    g.add_argument("--num-iters", type=int, default=3, help="timed pairs of runs [default: 3]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


def compile_times(llm: Any) -> dict[str, float]:
    """Seconds to set a backend up (read the vocabulary), then to compile MEDIUM_SCHEMA cold
    and again from the cache."""
    from treadle.structured_output.registry import backend_class
    from treadle.structured_output.params import StructuredOutputsParams

    config = llm.engine.config
    start = time.perf_counter()
    backend = backend_class(config.structured_outputs.backend)(
        llm.get_tokenizer(), config.model.vocab_size, llm.engine.input_processor.eos_token_id)
    setup = time.perf_counter() - start
    params = StructuredOutputsParams(json=MEDIUM_SCHEMA)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        backend.compile(params)
        times.append(time.perf_counter() - start)
    return {"backend_setup_s": setup, "compile_cold_s": times[0], "compile_cached_s": times[1]}


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM, SamplingParams
    from treadle.entrypoints.engine_cli_args import engine_args_from

    check_at_least(ns, input_len=1, output_len=1, num_iters=1)
    try:
        batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes must be integers separated by commas, "
                         f"got {ns.batch_sizes!r}") from None
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be >= 1, got {ns.batch_sizes!r}")
    engine_args = engine_args_from(ns)
    llm = LLM(**engine_args)
    compiled = compile_times(llm)
    runs = {"free": SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True),
            "json_schema": SamplingParams(temperature=0, max_tokens=ns.output_len,
                                          structured_outputs={"json": LONG_LIST})}
    results: dict[int, dict[str, float]] = {}
    for b in batch_sizes:
        times: dict[str, list[float]] = {name: [] for name in runs}
        for it in range(ns.num_iters + 1):   # the first pair warms up
            work = make_workload(llm.get_tokenizer(), b, (ns.input_len,) * 2, (1, 1), it)
            prompts = [{"prompt_token_ids": p} for p in work.prompts]
            for name, params in runs.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                assert all(len(o.outputs[0].token_ids) == ns.output_len for o in outs), name
                if it:
                    times[name].append(elapsed)
        step_ms = {name: 1000 * float(np.median(t)) / ns.output_len for name, t in times.items()}
        results[b] = step_ms | {"overhead_ms": step_ms["json_schema"] - step_ms["free"],
                                "ratio": step_ms["json_schema"] / step_ms["free"]}

    host = machine()
    out = sys.stdout
    out.write(f"{ns.input_len} prompt tokens, {ns.output_len} output tokens per request, median "
              f"of {ns.num_iters}; backend {llm.engine.config.structured_outputs.backend}; "
              f"{host['cpu']}, {host['cores']} cores, torch {host['torch']}\n\n")
    out.write("| batch | free ms/step | JSON schema ms/step | overhead ms/step | ratio |\n"
              "|---|---|---|---|---|\n")
    for b, r in results.items():
        out.write(f"| {b} | {r['free']:.1f} | {r['json_schema']:.1f} | {r['overhead_ms']:.2f} | "
                  f"{r['ratio']:.3f} |\n")
    out.write(f"\nmedium schema: backend set-up {compiled['backend_setup_s'] * 1000:.0f} ms, "
              f"compile cold {compiled['compile_cold_s'] * 1000:.1f} ms, cached "
              f"{compiled['compile_cached_s'] * 1000:.3f} ms\n")
    if ns.output_json:
        report = {"command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
                  "engine_args": engine_args, "steps": results, "compile": compiled}
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
