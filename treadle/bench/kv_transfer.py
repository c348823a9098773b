"""TTFT of a long shared prefix loaded from a KV store against recomputing it.

A producer engine (SharedStorageConnector, kv_producer) stores the KV of a prefix of
--prefix-len random ordinary tokens. Then a consumer engine (kv_consumer) and a plain engine
answer --num-requests prompts, each the prefix plus a fresh suffix, one request at a time with
max_tokens=1, alternating which engine goes first: the latency of each is its time to first
token. Local prefix caching is off on both, so every request either loads the prefix from the
store or recomputes it. The first tokens are compared, and the report gives the median TTFT of
each and their ratio."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from typing import Any

import numpy as np

from treadle.bench.throughput import check_at_least, machine, make_workload

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--prefix-len", type=int, default=2048, help="shared prefix tokens [default: 2048]")
    g.add_argument("--suffix-len", type=int, default=32, help="fresh tokens per request [default: 32]")
    g.add_argument("--num-requests", type=int, default=5, help="timed requests [default: 5]")
    g.add_argument("--store", default=None, metavar="DIR",
                   help="the KV store's folder [default: a new temporary folder]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM, SamplingParams
    from treadle.entrypoints.engine_cli_args import engine_args_from

    check_at_least(ns, prefix_len=1, suffix_len=1, num_requests=1)
    engine_args = engine_args_from(ns) | {"enable_prefix_caching": False}
    engine_args.pop("kv_transfer_config", None)   # this bench sets up its own
    if engine_args.get("max_model_len") is None:
        engine_args["max_model_len"] = ns.prefix_len + ns.suffix_len + 8
    store = ns.store or tempfile.mkdtemp(prefix="treadle-kv-")

    def kv(role: str) -> dict[str, Any]:
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": store}}

    producer = LLM(**engine_args, kv_transfer_config=kv("kv_producer"))
    tokenizer = producer.get_tokenizer()
    seed = engine_args.get("seed") or 0
    prefix = make_workload(tokenizer, 1, (ns.prefix_len,) * 2, (1, 1), seed).prompts[0]
    suffixes = make_workload(tokenizer, ns.num_requests + 1, (ns.suffix_len,) * 2, (1, 1),
                             seed + 1).prompts
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    producer.generate({"prompt_token_ids": prefix}, one, use_tqdm=False)
    store_s = time.perf_counter() - start
    del producer

    engines = {"from the store": LLM(**engine_args, kv_transfer_config=kv("kv_consumer")),
               "recomputed": LLM(**engine_args)}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    agree = 0
    for i, suffix in enumerate(suffixes):   # the first request of each engine warms it up
        prompt = {"prompt_token_ids": prefix + suffix}
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        first_tokens = {}
        for name in order:
            start = time.perf_counter()
            out = engines[name].generate(prompt, one, use_tqdm=False)[0]
            if i > 0:
                ttft[name].append(time.perf_counter() - start)
            first_tokens[name] = out.outputs[0].token_ids
            if name == "from the store" and out.num_cached_tokens == 0:
                raise RuntimeError("the consumer loaded nothing from the store")
        agree += i > 0 and first_tokens["from the store"] == first_tokens["recomputed"]

    medians = {name: float(np.median(v)) for name, v in ttft.items()}
    host = machine()
    report: dict[str, Any] = {
        "command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
        "workload": {"prefix_len": ns.prefix_len, "suffix_len": ns.suffix_len,
                     "num_requests": ns.num_requests, "seed": seed},
        "engine_args": engine_args, "store_prefix_s": store_s,
        "ttft_s": ttft, "median_ttft_s": medians,
        "speedup": medians["recomputed"] / medians["from the store"],
        "first_tokens_agree": f"{agree}/{ns.num_requests}",
    }
    out = sys.stdout
    out.write(f"prefix {ns.prefix_len} + suffix {ns.suffix_len} tokens, {ns.num_requests} timed "
              f"requests each; {host['cpu']}, {host['cores']} cores, torch {host['torch']}\n\n"
              "| prefix KV | median TTFT s | min s | max s |\n|---|---|---|---|\n")
    for name, values in ttft.items():
        out.write(f"| {name} | {medians[name]:.3f} | {min(values):.3f} | {max(values):.3f} |\n")
    out.write(f"\nTTFT speed-up from the store: {report['speedup']:.2f}x; first tokens agree on "
              f"{report['first_tokens_agree']}; storing the prefix took {store_s:.2f} s\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
