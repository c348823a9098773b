"""Offline throughput on a seeded synthetic workload: by default 64 requests with prompts of
32-512 random ordinary tokens and outputs of 32-256 tokens, ignore_eos, greedy. Reports
requests/s, output tokens/s and total (input + output) tokens/s. With --compare-hf,
transformers' `generate` runs the same prompts and output lengths in the same process
(batched, left-padded, KV cache on) and the treadle/transformers ratio is printed."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Untimed warm-up so neither side pays one-off costs (lazy init, first-call allocations) in the
# timed run; random tokens, so it shares no prefix-cache block with the workload.
_WARMUP_PROMPT_LEN = 16
_WARMUP_OUTPUT_LEN = 4


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
    output_tokens: int              # useful tokens only: each request's own requested length
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"requests_per_s": self.requests_per_s,
                               "output_tokens_per_s": self.output_tokens_per_s,
                               "total_tokens_per_s": self.total_tokens_per_s}

    def row(self) -> str:
        return (f"| {self.name} | {self.elapsed_s:.2f} | {self.requests_per_s:.3f} | "
                f"{self.output_tokens_per_s:.1f} | {self.total_tokens_per_s:.1f} |")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX integers, got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Benchmark flags only: the CLI adds the engine flags (--model, --seed, ...) itself."""
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, help="number of requests [default: 64]")
    g.add_argument("--input-len-range", type=_range, default=(32, 512), metavar="MIN,MAX",
                   help="prompt lengths, uniform in [MIN, MAX] tokens [default: 32,512]")
    g.add_argument("--min-input-len", type=int, default=None, help="overrides MIN of --input-len-range")
    g.add_argument("--max-input-len", type=int, default=None, help="overrides MAX of --input-len-range")
    g.add_argument("--output-len-range", type=_range, default=(32, 256), metavar="MIN,MAX",
                   help="output lengths, uniform in [MIN, MAX] tokens [default: 32,256]")
    g.add_argument("--min-output-len", type=int, default=None,
                   help="overrides MIN of --output-len-range")
    g.add_argument("--max-output-len", type=int, default=None,
                   help="overrides MAX of --output-len-range")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the tiny untimed warm-up request on each side")
    g = parser.add_argument_group("comparison and output")
    g.add_argument("--compare-async", action="store_true",
                   help="also run treadle with async scheduling flipped, in the same process")
    g.add_argument("--compare-hf", action="store_true",
                   help="also run transformers' generate on the same workload, same process")
    g.add_argument("--hf-batch-size", type=int, default=32,
                   help="transformers batch size (requests sorted by output length) [default: 32]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")
    g.add_argument("--no-tqdm", action="store_true", help="no progress bar")


def _resolve_range(rng: tuple[int, int], lo: int | None, hi: int | None, what: str) -> tuple[int, int]:
    lo_i = rng[0] if lo is None else lo
    hi_i = rng[1] if hi is None else hi
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"{what} lengths need 1 <= MIN <= MAX, got {lo_i},{hi_i}")
    return lo_i, hi_i


def ordinary_token_ids(tokenizer: Any) -> np.ndarray:
    """Vocabulary ids that are neither special nor added tokens (chat markers, EOS, ...)."""
    excluded = set(tokenizer.all_special_ids)
    excluded.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return np.array([t for t in range(len(tokenizer)) if t not in excluded], dtype=np.int64)


def make_workload(tokenizer: Any, num: int, input_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    vocab = ordinary_token_ids(tokenizer)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, num)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, num)
    prompts = [rng.choice(vocab, int(n)).tolist() for n in in_lens]
    return Workload(prompts, [int(n) for n in out_lens])


def run_treadle(llm: Any, work: Workload, use_tqdm: bool) -> tuple[Result, list[list[int]]]:
    from treadle import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    preempt_before = _preemptions(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(t) for t in tokens)
    if produced != work.output_tokens:
        # ignore_eos + max_tokens fixes every length; anything else is an engine bug.
        raise RuntimeError(f"treadle produced {produced} output tokens, expected {work.output_tokens}")
    extra: dict[str, Any] = {}
    if preempt_before is not None:
        extra["preemptions"] = _preemptions(llm) - preempt_before
    name = "treadle (async)" if llm.engine.config.scheduler.async_scheduling else "treadle"
    return Result(name, elapsed, len(outs), work.input_tokens, produced, extra), tokens


def _preemptions(llm: Any) -> int | None:
    # Internal counter, read only to explain a slow run; absent in other engine versions.
    return getattr(getattr(getattr(llm.engine, "core", None), "scheduler", None), "num_preemptions", None)


def load_hf_model(model_path: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def _hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    """One left-padded batch, greedy, KV cache on, exactly `new_tokens` new tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        # eos_token_id=None: no stopping on EOS, so every row runs to max_new_tokens like
        # treadle's ignore_eos; min_new_tokens pins the length should a version refill EOS.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, eos_token_id=None, do_sample=False,
                             use_cache=True, pad_token_id=pad_id, temperature=None, top_p=None,
                             top_k=None)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new_tokens}")
    return out[:, width:]


def run_hf(model: Any, work: Workload, batch_size: int, pad_id: int) -> tuple[Result, list[list[int]]]:
    """transformers' best honest setup: batched, left-padded with an attention mask, KV cache
    on, greedy, EOS suppressed. A batch runs until its longest request is done, so requests are
    sorted by output length first to cut that waste; only each request's own requested tokens
    count as useful output."""
    order = sorted(range(len(work.prompts)), key=lambda i: work.output_lens[i])
    tokens: list[list[int]] = [[] for _ in work.prompts]
    generated = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        new = max(work.output_lens[i] for i in batch)
        out = _hf_generate(model, [work.prompts[i] for i in batch], new, pad_id)
        generated += out.numel()
        for row, i in enumerate(batch):
            tokens[i] = out[row, :work.output_lens[i]].tolist()
    elapsed = time.perf_counter() - start
    extra = {"batch_size": batch_size, "sorted_by_output_len": True,
             "generated_tokens_incl_waste": generated}
    return Result("transformers", elapsed, len(work.prompts), work.input_tokens,
                  work.output_tokens, extra), tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two greedy runs agree. Informational: on random-token prompts near-ties are
    common, and fp32 kernels with different batch shapes may flip one, then the rest differ."""
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n / max(len(x), 1))
    return {"identical_requests": sum(p == 1.0 for p in prefixes), "requests": len(prefixes),
            "mean_common_prefix_fraction": float(np.mean(prefixes)) if prefixes else 1.0}


def check_at_least(ns: argparse.Namespace, **lows: int) -> None:
    """ValueError naming the flag if any `ns.<name>` is below its low bound."""
    for name, low in lows.items():
        value = getattr(ns, name)
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def _resolved_engine(llm: Any) -> dict[str, Any]:
    """The engine settings as resolved (defaults filled in), for the report."""
    cfg = llm.engine.config
    info: dict[str, Any] = {
        "model": cfg.model.model, "dtype": str(cfg.model.dtype).removeprefix("torch."),
        "quantization": cfg.model.quantization,
        "max_model_len": cfg.model.max_model_len, "device": cfg.device,
        "block_size": cfg.cache.block_size, "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": cfg.scheduler.enable_chunked_prefill,
        "scheduling_policy": cfg.scheduler.scheduling_policy,
    }
    blocks = getattr(getattr(getattr(llm.engine, "core", None), "executor", None), "num_blocks", None)
    if blocks is not None:
        info["num_kv_blocks"] = blocks
    return info


def _warmup_workload(tokenizer: Any, seed: int) -> Workload:
    # A seed apart from the workload's, so the warm-up shares no prompt with it.
    return make_workload(tokenizer, 1, (_WARMUP_PROMPT_LEN,) * 2, (_WARMUP_OUTPUT_LEN,) * 2, seed + 1_000_003)


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM
    from treadle.entrypoints.engine_cli_args import engine_args_from

    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {ns.hf_batch_size}")
    in_range = _resolve_range(ns.input_len_range, ns.min_input_len, ns.max_input_len, "input")
    out_range = _resolve_range(ns.output_len_range, ns.min_output_len, ns.max_output_len, "output")
    engine_args = engine_args_from(ns)
    seed = engine_args.get("seed") or 0
    host = machine()  # taken now, so the date is when the run started

    llm = LLM(**engine_args)
    tokenizer = llm.get_tokenizer()
    resolved = _resolved_engine(llm)
    work = make_workload(tokenizer, ns.num_prompts, in_range, out_range, seed)
    warm = None if ns.no_warmup else _warmup_workload(tokenizer, seed)
    if warm is not None:
        run_treadle(llm, warm, use_tqdm=False)
    logger.info("treadle: %d requests, %d input + %d output tokens",
                ns.num_prompts, work.input_tokens, work.output_tokens)
    result, treadle_tokens = run_treadle(llm, work, use_tqdm=not ns.no_tqdm)
    results = [result]
    agree = None

    if ns.compare_async:
        flipped = engine_args | {"async_scheduling": not llm.engine.config.scheduler.async_scheduling}
        del llm
        gc.collect()
        llm = LLM(**flipped)
        if warm is not None:
            run_treadle(llm, warm, use_tqdm=False)
        other, other_tokens = run_treadle(llm, work, use_tqdm=not ns.no_tqdm)
        results.append(other)
        if other_tokens != treadle_tokens:
            raise RuntimeError("greedy output differs between sync and async scheduling")

    if ns.compare_hf:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        model_path = resolved["model"]
        # Free the engine's weights and KV cache before the second copy is loaded.
        del llm
        gc.collect()
        # Same dtype as the engine, so --dtype bfloat16 compares like with like.
        logger.info("loading %s in transformers, %s (not timed)", model_path, resolved["dtype"])
        model = load_hf_model(model_path, getattr(torch, resolved["dtype"]))
        if warm is not None:
            run_hf(model, warm, 1, pad)
        hf_result, hf_tokens = run_hf(model, work, ns.hf_batch_size, pad)
        results.append(hf_result)
        agree = agreement(treadle_tokens, hf_tokens)
        del model

    report = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "machine": host,
        "workload": {"num_prompts": ns.num_prompts, "input_len_range": list(in_range),
                     "output_len_range": list(out_range), "seed": seed,
                     "input_tokens": work.input_tokens, "output_tokens": work.output_tokens,
                     "ignore_eos": True, "greedy": True, "warmup": warm is not None},
        "engine_args": engine_args,
        "engine_resolved": resolved,
        "results": [r.to_dict() for r in results],
    }
    hf = results[-1] if results[-1].name == "transformers" else None
    if hf is not None:
        report["ratio_output_tokens_per_s"] = results[0].output_tokens_per_s / hf.output_tokens_per_s
        report["greedy_agreement"] = agree
    _write_report(report, results)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


def _write_report(report: dict[str, Any], results: list[Result]) -> None:
    out = sys.stdout
    w, m = report["workload"], report["machine"]
    out.write(f"workload: {w['num_prompts']} requests, input len {w['input_len_range']} "
              f"({w['input_tokens']} tokens), output len {w['output_len_range']} "
              f"({w['output_tokens']} tokens), seed {w['seed']}, ignore_eos, greedy, "
              f"warm-up {'on' if w['warmup'] else 'off'}\n")
    out.write(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
              f"({m['torch_threads']} threads), python {m['python']}, started {m['date']}\n")
    out.write(f"engine: {json.dumps(report['engine_resolved'], default=str)}\n\n")
    out.write("| engine | elapsed s | requests/s | output tok/s | total tok/s |\n"
              "|---|---|---|---|---|\n")
    for r in results:
        out.write(r.row() + "\n")
    treadle = results[0]
    if "preemptions" in treadle.extra:
        out.write(f"\ntreadle preemptions: {treadle.extra['preemptions']}\n")
    if len(results) > 1 and results[1].name.startswith("treadle"):
        out.write(f"\n{results[1].name} / {results[0].name}, output tokens/s: "
                  f"{results[1].output_tokens_per_s / results[0].output_tokens_per_s:.3f}x "
                  f"(identical greedy output)\n")
    hf = results[-1] if results[-1].name == "transformers" else None
    if hf is not None:
        useful = hf.output_tokens / hf.extra["generated_tokens_incl_waste"]
        out.write(f"transformers: batch size {hf.extra['batch_size']}, requests sorted by output "
                  f"length before batching; only requested tokens counted "
                  f"({useful:.0%} of the tokens it generated)\n")
        a = report["greedy_agreement"]
        out.write(f"greedy agreement: {a['identical_requests']}/{a['requests']} requests identical, "
                  f"mean common prefix {a['mean_common_prefix_fraction']:.0%}\n")
        out.write(f"\ntreadle / transformers, output tokens/s: "
                  f"{report['ratio_output_tokens_per_s']:.2f}x\n")
