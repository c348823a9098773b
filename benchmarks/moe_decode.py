"""Decode with a mixture of experts: the engine's grouped experts (each chosen expert once, over
the tokens that chose it, so a step reads only those experts' weights) against running every
expert on every token and weighting by the routing (what a dense implementation does).

    .venv/bin/python benchmarks/moe_decode.py [--batch 1 8] [--rounds 2]

A random Qwen3-MoE from a config (no download): hidden 512, 4 layers, 32 experts of 256
features, 4 per token, about 200 MB of fp32 expert weights, more than the CPU's caches hold.
Both sides run in this process, in turns, through `LLM.generate` (32 prompt tokens, 64 out);
prints ms per output step. Time nothing else while it runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from treadle import LLM, SamplingParams
from treadle.models.loader import default_model_path, load_tokenizer
from treadle.models.moe import SparseMoeBlock

PROMPT, OUTPUT = 32, 64


# This bench's model; benchmarks/model_families.py builds a larger one through build_model.
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=256, max_position_embeddings=1024)


def build_model(path: str, shape: dict = SHAPE) -> int:
    """A random, tied Qwen3-MoE of `shape` with the embedded tokenizer at `path`; its
    parameter count."""
    import transformers

    tokenizer = load_tokenizer(default_model_path())
    config = transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def every_expert(self: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; the routing weights (zero where not chosen) mix them."""
    weights, experts = self.route(x)
    mix = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype).scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(self.experts):
        out += (expert(x) * mix[:, e, None]).to(out.dtype)
    return self.ctx.all_reduce(out)


def ms_per_step(llm: LLM, batch: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (PROMPT,), generator=gen).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) * 1000 / OUTPUT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    ns = parser.parse_args()
    grouped = SparseMoeBlock.forward
    with tempfile.TemporaryDirectory() as path:
        build_model(path)
        with LLM(path, dtype="float32", enable_prefix_caching=False, num_kv_blocks=64) as llm:
            ms_per_step(llm, 1)   # warm-up
            results: dict[tuple[str, int], list[float]] = {}
            for _ in range(ns.rounds):
                for side, forward in (("grouped", grouped), ("every expert", every_expert)):
                    SparseMoeBlock.forward = forward
                    for batch in ns.batch:
                        results.setdefault((side, batch), []).append(ms_per_step(llm, batch))
            SparseMoeBlock.forward = grouped
    print("| batch | grouped, ms/step | every expert, ms/step | ratio |")
    print("|---|---|---|---|")
    for batch in ns.batch:
        g = statistics.median(results[("grouped", batch)])
        e = statistics.median(results[("every expert", batch)])
        print(f"| {batch} | {g:.1f} | {e:.1f} | {e / g:.2f}x |")


if __name__ == "__main__":
    main()
