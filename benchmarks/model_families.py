"""Issue 48's figures for the new model families, from random models built from configs (no
download):

    .venv/bin/python benchmarks/model_families.py moe-checkpoint DIR
        A Qwen3-MoE of about 300M parameters (Qwen3-30B-A3B's layout scaled down: 8 experts,
        2 per token), saved at DIR for `treadle bench throughput --model DIR --compare-hf`.
    .venv/bin/python benchmarks/model_families.py moe-bytes DIR
        Weight bytes a decode step reads at batch 1 and 8, from the experts the routing chose
        in each layer at each step, against a dense model of the same parameters.
    .venv/bin/python benchmarks/model_families.py window
        KV blocks a windowed Mistral holds on a long prompt, at their peak while it runs,
        against the whole sequence's blocks (what a cache without the window's freeing holds).
    .venv/bin/python benchmarks/model_families.py hybrid
        The same for a Gemma 3 of five local layers to a global one, with a block table per
        group of layers (core/kv_cache_groups.py), against one table for every layer.

Time nothing else while one runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from treadle import LLM, SamplingParams  # noqa: E402
from treadle.config import window_reach  # noqa: E402
from moe_decode import build_model  # noqa: E402 (this folder, the script's own)
from treadle.models.moe import SparseMoeBlock  # noqa: E402

MIB = 2 ** 20


# Qwen3-30B-A3B's layout scaled down to about 300M parameters.
MOE_300M = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=768, max_position_embeddings=4096,
                norm_topk_prob=True)


def moe_bytes(path: str) -> None:
    """Per decode step: the bytes of every weight outside the experts (the tied head included,
    read whole) plus the chosen experts' (each distinct expert once per layer)."""
    chosen: list[int] = []   # distinct experts per layer call
    route = SparseMoeBlock.route

    def counting_route(self: SparseMoeBlock, x: torch.Tensor):
        weights, experts = route(self, x)
        chosen.append(int(experts.unique().numel()))
        return weights, experts

    SparseMoeBlock.route = counting_route
    try:
        with LLM(path, dtype="float32", enable_prefix_caching=False, num_kv_blocks=64) as llm:
            model = llm.engine.core.executor.worker.runner.model
            blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
            expert_bytes = sum(p.numel() * p.element_size() for p in blocks[0].experts[0].parameters())
            in_experts = {id(p) for b in blocks for e in b.experts for p in e.parameters()}
            other = sum(p.numel() * p.element_size() for p in model.parameters()
                        if id(p) not in in_experts)
            dense = other + len(blocks) * blocks[0].num_experts * expert_bytes
            print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; "
                  f"{len(blocks)} MoE layers of {blocks[0].num_experts} experts, "
                  f"{expert_bytes / MIB:.1f} MiB each; {other / MIB:.0f} MiB outside them")
            print("| batch | experts read per layer (mean) | MiB read per step | dense MiB | ratio |")
            print("|---|---|---|---|---|")
            for batch in (1, 8):
                gen = torch.Generator().manual_seed(batch)
                prompts = [{"prompt_token_ids": torch.randint(100, 40000, (32,), generator=gen).tolist()}
                           for _ in range(batch)]
                params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
                chosen.clear()
                llm.generate(prompts, params, use_tqdm=False)
                decode = chosen[len(blocks):]   # the layer calls after the prefill step's
                mean = sum(decode) / len(decode)
                read = other + len(blocks) * mean * expert_bytes
                print(f"| {batch} | {mean:.2f} | {read / MIB:.0f} | {dense / MIB:.0f} | "
                      f"{dense / read:.2f}x fewer |")
    finally:
        SparseMoeBlock.route = route


def window(prompt_len: int, window_len: int, block_size: int) -> None:
    """A 2-layer Mistral with Mistral-7B's window and block shape scaled down; the KV it holds
    is converted to Mistral-7B's bytes per token (32 layers, 8 KV heads of 128, bf16)."""
    from tests.tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        path = make_tiny_checkpoint("mistral", folder, tie_word_embeddings=False,
                                    sliding_window=window_len, max_position_embeddings=prompt_len + 64,
                                    num_hidden_layers=2)
        blocks_needed = -(-(prompt_len + 16) // block_size) + 1
        with LLM(path, dtype="float32", block_size=block_size, num_kv_blocks=blocks_needed,
                 max_num_batched_tokens=512, enable_prefix_caching=False) as llm:
            engine = llm.engine
            pool = engine.core.scheduler.kv_cache.pool
            engine.add_request("long", {"prompt_token_ids": list(range(100, 100 + prompt_len))},
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            peak = 0
            while engine.has_unfinished_requests():
                engine.step()
                peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
            freed = engine.core.scheduler.kv_cache.num_window_freed_blocks
    whole = -(-(prompt_len + 16) // block_size)
    per_token_7b = 32 * 2 * 8 * 128 * 2
    print(f"prompt {prompt_len} + 16 output tokens, window {window_len}, blocks of {block_size}, "
          f"chunks of 512: {freed} blocks given back while it ran")
    print("| | blocks held at peak | Mistral-7B bf16 KV at that |")
    print("|---|---|---|")
    print(f"| whole sequence (no freeing) | {whole} | {whole * block_size * per_token_7b / MIB:.0f} MiB |")
    print(f"| window's blocks freed | {peak} | {peak * block_size * per_token_7b / MIB:.0f} MiB |")
    print(f"saved: {1 - peak / whole:.0%}")


def hybrid(prompt_len: int, window_len: int, block_size: int) -> None:
    """A 6-layer Gemma 3 (five local layers, then a global one) with Gemma-3-12B's window; the
    layer-blocks it holds at their peak (each group's block serves one layer here), against
    one table for every layer holding the whole sequence, priced at Gemma-3-12B's KV (48 layers
    in the same 5:1 pattern, 8 KV heads of 256, bf16: 384 KiB a token)."""
    from tests.tiny_models import make_tiny_checkpoint

    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    with tempfile.TemporaryDirectory() as folder:
        path = make_tiny_checkpoint("gemma3", folder, tie_word_embeddings=False,
                                    sliding_window=window_len, layer_types=layer_types,
                                    num_hidden_layers=6, max_position_embeddings=prompt_len + 64)
        blocks_needed = 6 * (-(-(prompt_len + 16) // block_size)) + 1
        with LLM(path, dtype="float32", block_size=block_size, num_kv_blocks=blocks_needed,
                 max_num_batched_tokens=512, enable_prefix_caching=False) as llm:
            engine = llm.engine
            kv = engine.core.scheduler.kv_cache
            assert kv.num_groups == 6 and engine.core.config.cache.kv_groups.group_size == 1
            engine.add_request("long", {"prompt_token_ids": list(range(100, 100 + prompt_len))},
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            peak = 0
            while engine.has_unfinished_requests():
                engine.step()
                peak = max(peak, kv.pool.num_usable_blocks - kv.pool.num_free_blocks)
            freed = kv.num_window_freed_blocks
            config = engine.core.config
            # The longest request a cache of just the peak admits: counting every group as
            # holding all of it (before), and each local group as its window and a step's reach.
            longest = {name: config.cache.capacity_tokens(peak + 1, reach)
                       for name, reach in (("every group all of it", None),
                                           ("local groups their window", window_reach(config)))}
    whole = 6 * -(-(prompt_len + 16) // block_size)   # layer-blocks: a block per layer
    per_layer_token_12b = 8 * (2 * 8 * 256 * 2)   # a layer here stands for 8 of 12B's: 64 KiB a token
    print(f"prompt {prompt_len} + 16 output tokens, window {window_len}, blocks of {block_size}, "
          f"chunks of 512: {freed} blocks given back while it ran")
    print("| | layer-blocks held at peak | Gemma-3-12B bf16 KV at that |")
    print("|---|---|---|")
    for name, n in (("one table, whole sequence", whole), ("a table per group", peak)):
        print(f"| {name} | {n} | {n * block_size * per_layer_token_12b / MIB:.0f} MiB |")
    print(f"saved: {1 - peak / whole:.0%}")
    print(f"the longest request a cache of {peak} blocks admits (max_model_len's cap):")
    for name, tokens in longest.items():
        print(f"| counting {name} | {'any length' if tokens is None else f'{tokens:,} tokens'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    sub.add_parser("moe-checkpoint").add_argument("dir")
    sub.add_parser("moe-bytes").add_argument("dir")
    win = sub.add_parser("window")
    win.add_argument("--prompt-len", type=int, default=16384)
    win.add_argument("--window", type=int, default=4096)
    win.add_argument("--block-size", type=int, default=16)
    hyb = sub.add_parser("hybrid")
    hyb.add_argument("--prompt-len", type=int, default=16384)
    hyb.add_argument("--window", type=int, default=1024)
    hyb.add_argument("--block-size", type=int, default=16)
    ns = parser.parse_args()
    if ns.part == "moe-checkpoint":
        print(f"{build_model(ns.dir, MOE_300M) / 1e6:.0f}M parameters at {ns.dir}")
    elif ns.part == "moe-bytes":
        moe_bytes(ns.dir)
    elif ns.part == "window":
        window(ns.prompt_len, ns.window, ns.block_size)
    else:
        hybrid(ns.prompt_len, ns.window, ns.block_size)


if __name__ == "__main__":
    main()
