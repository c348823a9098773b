"""Greedy output is token-identical to transformers, however the engine batches and caches.

Each configuration pushes a different engine path: chunked prefill, preemption and recompute,
prefix-cache hits (including identical prompts scheduled in one step and a multi-turn prompt
that extends an earlier output), one sequence at a time, and mixed lengths in one batch.
"""

from __future__ import annotations

import pytest

from treadle import LLM, SamplingParams
from treadle.attention import torch_backend

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
    "weaver who spent her days at the loom. Every morning she would",
    "1, 2, 3, 4, 5,",
]
MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt_ids(llm: LLM, texts=TEXTS) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in texts]


def assert_matches_reference(llm: LLM, ref, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    for p, out in zip(prompts, outs):
        expected = ref.greedy(p, max_tokens)
        got = out.outputs[0].token_ids
        assert got == expected, f"prompt {p[:8]}...: got {got}, expected {expected}"
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return outs


CONFIGS = {
    "plain": {},
    "chunked_prefill_32": {"max_num_batched_tokens": 32},
    "max_num_seqs_1": {"max_num_seqs": 1},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "block_size_8": {"block_size": 8},
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_tiny_models_match_transformers(tiny_checkpoints, reference, arch, config):
    path = tiny_checkpoints[arch]
    llm = LLM(path, **CONFIGS[config])
    assert_matches_reference(llm, reference(path), prompt_ids(llm))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_under_preemption(tiny_checkpoints, reference, arch):
    path = tiny_checkpoints[arch]
    # 5 prompts of ~15-40 tokens + 40 outputs need ~25 blocks of 8; give them 12.
    llm = LLM(path, block_size=8, num_kv_blocks=12, max_num_batched_tokens=32)
    assert_matches_reference(llm, reference(path), prompt_ids(llm), max_tokens=40)
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    return LLM(smollm2_path)


def test_smollm2_plain(smollm2_llm, smollm2_path, reference):
    assert_matches_reference(smollm2_llm, reference(smollm2_path), prompt_ids(smollm2_llm))


def test_smollm2_identical_prompts_share_prefix_in_one_step(smollm2_llm, smollm2_path, reference):
    smollm2_llm.reset_prefix_cache()
    block = smollm2_llm.engine.core.scheduler.kv_cache.block_size   # the CPU default, 128
    long_text = " ".join(TEXTS * 2)   # more than one block of 128
    prompts = prompt_ids(smollm2_llm, [long_text] * 3)
    assert len(prompts[0]) > block
    outs = assert_matches_reference(smollm2_llm, reference(smollm2_path), prompts)
    # The first computes the prefix; the others, scheduled in the same step, reuse its blocks.
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= block for o in outs[1:])


def test_smollm2_multi_turn_extends_earlier_output(smollm2_llm, smollm2_path, reference):
    ref = reference(smollm2_path)
    block = smollm2_llm.engine.core.scheduler.kv_cache.block_size
    first = prompt_ids(smollm2_llm, [" ".join((TEXTS[1:] + TEXTS[:1]) * 3)])[0]
    out1 = assert_matches_reference(smollm2_llm, ref, [first])[0]
    follow_up = first + out1.outputs[0].token_ids + smollm2_llm.get_tokenizer().encode(" And then")
    out2 = assert_matches_reference(smollm2_llm, ref, [follow_up])[0]
    # Prompt and generated blocks of the first turn are hits for the second.
    assert (len(first) + MAX_TOKENS) // block >= 2   # at least one whole block to hit
    assert out2.num_cached_tokens >= (len(first) + MAX_TOKENS) // block * block - block


def test_smollm2_long_context_decodes_in_parts(smollm2_llm, smollm2_path, reference):
    """A context past 1,024 tokens: the decode kernel splits it into parts that the threads
    share and merges them (kernels/csrc/decode_items.h), beside a short prompt that it does not
    split."""
    smollm2_llm.reset_prefix_cache()
    long_ids, short_ids = prompt_ids(smollm2_llm, [" ".join(TEXTS * 14), TEXTS[2]])
    assert len(long_ids) > 1024
    assert_matches_reference(smollm2_llm, reference(smollm2_path), [long_ids, short_ids])


def test_smollm2_chunked_preempted_mixed_lengths(smollm2_path, reference):
    llm = LLM(smollm2_path, max_num_batched_tokens=32, block_size=16, num_kv_blocks=14, max_num_seqs=4)
    assert_matches_reference(llm, reference(smollm2_path), prompt_ids(llm), max_tokens=32)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_smollm2_one_sequence_at_a_time(smollm2_path, reference):
    llm = LLM(smollm2_path, max_num_seqs=1, max_num_batched_tokens=48)
    assert_matches_reference(llm, reference(smollm2_path), prompt_ids(llm)[:3])


@pytest.mark.parametrize("budget", [16, 64])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_chunks_match_transformers(tiny_checkpoints, reference, arch, budget, monkeypatch):
    """The torch decode path (the C++ kernel switched off): decodes are sorted longest first
    and cut into chunks; with a tiny chunk budget every chunk holds one or two requests, so a
    row sent to or read back from the wrong place, or a request sorted away from its block
    table, shows."""
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "0")
    monkeypatch.setattr(torch_backend, "DECODE_CHUNK_TOKENS", budget)
    path = tiny_checkpoints[arch]
    llm = LLM(path, block_size=16)
    assert not llm.engine.core.executor.worker.runner.native_kernels
    assert llm.engine.core.executor.worker.runner.attention.name == "torch"
    assert_matches_reference(llm, reference(path), prompt_ids(llm), max_tokens=40)
