"""Offline throughput on a seeded synthetic workload (by default 64 requests, prompts of 32-512
tokens, outputs of 32-256 tokens, ignore_eos, greedy). With --compare-hf, transformers'
`generate` runs the same prompts and lengths in the same process, and the ratio is printed."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    name: str
    elapsed_s: float
    requests: int
    input_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def row(self) -> str:
        return (f"| {self.name} | {self.elapsed_s:.1f} | {self.requests_per_s:.2f} | "
                f"{self.output_tokens_per_s:.1f} | {self.total_tokens_per_s:.1f} |")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=_range, default=(32, 512), metavar="MIN,MAX")
    parser.add_argument("--output-len-range", type=_range, default=(32, 256), metavar="MIN,MAX")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run transformers' generate on the same workload")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--output-json", default=None, help="save the figures here")
    parser.add_argument("--no-tqdm", action="store_true")


def make_workload(tokenizer, num: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = np.array([t for t in range(len(tokenizer)) if t not in special])
    in_lens = rng.integers(input_range[0], input_range[1] + 1, num)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, num)
    prompts = [rng.choice(ordinary, n).tolist() for n in in_lens]
    return Workload(prompts, [int(n) for n in out_lens])


def run_treadle(llm, work: Workload, use_tqdm: bool) -> Result:
    from treadle import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == work.output_tokens, (produced, work.output_tokens)
    return Result("treadle", elapsed, len(outs), work.input_tokens, produced)


def run_hf(model_path: str, work: Workload, batch_size: int, pad_id: int) -> Result:
    """transformers' best honest setup: batched, left-padded, KV cache on, greedy.

    A batch runs until its longest request is done, so requests are sorted by output length
    first to cut that waste; only each request's own requested tokens count as useful.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    order = sorted(range(len(work.prompts)), key=lambda i: work.output_lens[i])
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        width = max(len(work.prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            p = work.prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(work.output_lens[i] for i in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, use_cache=True, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return Result("transformers", elapsed, len(work.prompts), work.input_tokens, work.output_tokens)


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM
    from treadle.entrypoints.cli import engine_args_from

    engine_args = engine_args_from(ns)
    llm = LLM(**engine_args)
    tokenizer = llm.get_tokenizer()
    work = make_workload(tokenizer, ns.num_prompts, ns.input_len_range, ns.output_len_range, ns.seed)
    results = [run_treadle(llm, work, use_tqdm=not ns.no_tqdm)]
    if ns.compare_hf:
        del llm  # free the engine's KV cache before loading the second model
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        results.append(run_hf(_hf_loadable(ns.model), work, ns.hf_batch_size, pad))

    out = sys.stdout
    out.write(f"workload: {ns.num_prompts} requests, input {ns.input_len_range}, "
              f"output {ns.output_len_range}, seed {ns.seed}, ignore_eos, greedy\n")
    out.write(f"machine: {json.dumps(machine())}\n\n")
    out.write("| engine | elapsed s | requests/s | output tok/s | total tok/s |\n|---|---|---|---|---|\n")
    for r in results:
        out.write(r.row() + "\n")
    if len(results) == 2:
        ratio = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        out.write(f"\ntreadle / transformers, output tokens/s: {ratio:.2f}x\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"machine": machine(), "engine_args": {k: v for k, v in engine_args.items()},
                       "workload": {"num_prompts": ns.num_prompts, "input": ns.input_len_range,
                                    "output": ns.output_len_range, "seed": ns.seed},
                       "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s}
                                   for r in results]}, f, indent=2)
    return 0


def _hf_loadable(model: str | None) -> str:
    from treadle.models.loader import prepare_model

    # The converted folder holds exactly the engine's weights, in a form transformers reads fast.
    return prepare_model(model)
