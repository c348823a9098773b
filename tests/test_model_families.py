"""Phi-3 (fused checkpoint weights, LongRoPE, RoPE over part of each head) and Mistral: greedy
fp32 output token-identical to transformers loading the same folder, batched, chunked,
preempted and with prefix hits, and split over worker processes; and Mistral's window given to
every layer, max_model_len no longer capped at it."""

from __future__ import annotations

import os

import pytest
import torch

from tests.family_support import MAX_TOKENS, TIGHT, PretrainedReference as Reference, greedy_ids
from tests.family_support import random_prompts
from tests.tiny_models import OTHER_ARCHS, tiny_checkpoint_dir
from treadle import LLM, SamplingParams
from treadle.models.rope import RotaryEmbedding



@pytest.fixture(scope="module", params=OTHER_ARCHS)
def family(request, tmp_path_factory) -> tuple[str, str]:
    arch = request.param
    return arch, tiny_checkpoint_dir(arch, tmp_path_factory, tie_word_embeddings=False)


def prompts(n: int = 4) -> list[list[int]]:
    return random_prompts(n, 9, seed=11)


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return greedy_ids(llm, batch)


def test_batched_chunked_preempted_and_prefix_hits_match_transformers(family):
    arch, path = family
    ref = Reference(path)
    batch = prompts()
    want = [ref.greedy(p, MAX_TOKENS) for p in batch]
    with LLM(path, dtype="float32", **TIGHT) as llm:
        assert generate(llm, batch) == want
        assert llm.get_stats().num_preemptions > 0
        assert generate(llm, batch[2:]) == want[2:]
        assert llm.get_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("arch, pp, tp", [("phi3", 1, 2), ("mistral", 3, 1)])
def test_split_over_worker_processes_matches_transformers(tmp_path_factory, arch, pp, tp):
    """TP splits Phi-3's fused checkpoint weights part by part, as it splits Llama's."""
    path = tiny_checkpoint_dir(arch, tmp_path_factory, tie_word_embeddings=False)
    ref = Reference(path)
    batch = prompts(3)
    with LLM(path, dtype="float32", pipeline_parallel_size=pp, tensor_parallel_size=tp,
             distributed_executor_backend="mp", **TIGHT) as llm:
        assert generate(llm, batch) == [ref.greedy(p, MAX_TOKENS) for p in batch]


def test_phi3_rope_tables_and_fused_weights_are_transformers(tmp_path_factory):
    """LongRoPE's short factors and attention factor, over half of each head; the fused qkv
    weight, split for loading and fused again, is the checkpoint's."""
    path = tiny_checkpoint_dir("phi3", tmp_path_factory, tie_word_embeddings=False)
    hf = Reference(path).model
    # No step runs: a small step budget spares the untied head's GEMM warm-up (49,152 rows, at
    # every row count up to the budget) at start-up.
    with LLM(path, dtype="float32", num_kv_blocks=20, block_size=16,
             max_num_batched_tokens=64) as llm:
        model = llm.engine.core.executor.worker.runner.model
        rotary: RotaryEmbedding = model.model.rotary
        assert rotary.dim == 8   # half of each 16-feature head
        for position in (0, 5, 255):
            cos, sin = hf.model.rotary_emb(torch.zeros(1, 1, 8), torch.tensor([[position]]))
            assert torch.allclose(rotary.cos[position], cos[0, 0], atol=1e-6)
            assert torch.allclose(rotary.sin[position], sin[0, 0], atol=1e-6)
        assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight,
                           hf.model.layers[0].self_attn.qkv_proj.weight)
        # Past the original context (256 of 1,024 positions) the long factors' tables follow
        # the short ones; transformers takes them for a whole forward whose last position is
        # past it.
        assert rotary.long_rope_offset == 1024   # rows for every position the model has
        cos, sin = hf.model.rotary_emb(torch.zeros(1, 1, 8), torch.tensor([[5, 300]]))
        for i, position in enumerate((5, 300)):
            assert torch.allclose(rotary.cos[rotary.long_rope_offset + position], cos[0, i], atol=1e-6)
            assert torch.allclose(rotary.sin[rotary.long_rope_offset + position], sin[0, i], atol=1e-6)
        assert not torch.allclose(rotary.cos[300], cos[0, 1], atol=1e-3)


# Prompts around the original context (256): one past it from the start, two that cross it
# while generating (after 7 and after 17 tokens), one that never reaches it.
LONG_ROPE_LENGTHS = (300, 250, 240, 100)


@pytest.mark.parametrize("mode", [
    {},
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "async_scheduling": True},
], ids=["sync", "async", "ngram", "pp2-async"])
def test_phi3_past_the_original_context_matches_transformers(tmp_path_factory, mode):
    """LongRoPE past the original context: a prompt longer than it takes the long factors
    throughout; a request that grows past it is recomputed with them, as transformers' generate
    does, batched, chunked, preempted and with prefix hits."""
    path = tiny_checkpoint_dir("phi3", tmp_path_factory, tie_word_embeddings=False)
    ref = Reference(path)
    gen = torch.Generator().manual_seed(5)
    batch = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in LONG_ROPE_LENGTHS]
    # Repeats, so that n-gram drafts are proposed and accepted.
    batch[1] = (batch[1][:50] * 5)[:250]
    want = [ref.greedy(p, MAX_TOKENS) for p in batch]
    with LLM(path, dtype="float32", max_num_batched_tokens=64, block_size=16, num_kv_blocks=48,
             max_num_seqs=4, **mode) as llm:
        assert generate(llm, batch) == want
        assert llm.get_stats().num_preemptions > 0
        assert generate(llm, batch[1:3]) == want[1:3]
        assert llm.get_stats().prefix_cache_hits > 0


def test_phi3_prompt_logprobs_survive_the_restart_past_the_original_context(tmp_path_factory):
    """A request that grows past the original context restarts with the long factors, which
    computes its prompt again: the prompt's logprobs stay those of the prompt alone, as
    transformers scores it, and not the restart's (a helper's hunt: off by up to 200)."""
    path = tiny_checkpoint_dir("phi3", tmp_path_factory, tie_word_embeddings=False)
    prompt = torch.randint(100, 20000, (250,), generator=torch.Generator().manual_seed(0)).tolist()
    with LLM(path, dtype="float32", max_num_batched_tokens=64, block_size=16) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                          prompt_logprobs=0), use_tqdm=False)[0]
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    assert torch.allclose(got, Reference(path).prompt_logprobs(prompt), atol=1e-3)


def test_a_sliding_window_does_not_cap_max_model_len(tmp_path_factory):
    """Mistral's tiny window is 512 of 1,024 positions: every layer keeps to it exactly
    (tests/test_sliding_window.py), so max_model_len is the model's, not the window's."""
    path = tiny_checkpoint_dir("mistral", tmp_path_factory, tie_word_embeddings=False)
    with LLM(path, dtype="float32", num_kv_blocks=70, block_size=16) as llm:
        assert llm.engine.config.model.max_model_len == 1024
        layers = llm.engine.core.executor.worker.runner.model.model.layers
        assert all(layer.self_attn.attn.sliding_window == 512 for layer in layers)


# Config fields a model would run silently wrong with, or crash on deep inside (a kernel, the
# first step), refused before any worker starts (a helper's finds).
BAD_FIELDS = [("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
              ("mistral", {"sliding_window": -4}, "sliding_window must be a positive"),
              ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be"),
              ("llama", {"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads")]


@pytest.mark.parametrize("arch, fields, message", BAD_FIELDS, ids=[f"{a}-{next(iter(f))}"
                                                                   for a, f, _ in BAD_FIELDS])
def test_a_config_field_no_model_runs_is_refused_by_name(tmp_path, arch, fields, message):
    import json

    from tests.tiny_models import make_tiny_checkpoint
    from treadle import EngineArgs

    path = make_tiny_checkpoint(arch, tmp_path, tie_word_embeddings=False)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, **fields}, f)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=path).create_config()
