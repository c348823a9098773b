"""Gemma 2 and Gemma 3 (treadle/models/gemma.py): tiny random checkpoints whose 24-token windows
are shorter than every prompt, greedy fp32 output token-identical to transformers loading the
same folder, batched, chunked, preempted and with prefix hits, on both attention backends, and
split over worker processes (TP=2, PP=2)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import CPU
from tests.family_support import MAX_TOKENS, PretrainedReference as Reference, greedy_ids, tight_for
from tests.family_support import random_prompts
from tests.tiny_models import GEMMA_ARCHS, make_tiny_checkpoint, tiny_checkpoint_dir
from treadle import LLM, SamplingParams
from treadle.attention.cpu_backend import CpuKernelBackend
from treadle.models.registry import get_model_class

WINDOW = 24


@pytest.fixture(scope="module", params=GEMMA_ARCHS)
def gemma(request, tmp_path_factory) -> tuple[str, str]:
    arch = request.param
    return arch, tiny_checkpoint_dir(arch, tmp_path_factory, tie_word_embeddings=False)


def prompts(n: int = 4) -> list[list[int]]:
    """30 to 81 tokens: every one longer than the window."""
    return random_prompts(n, 30, seed=3)


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return greedy_ids(llm, batch)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_batched_chunked_preempted_and_prefix_hits_match_transformers(gemma, backend):
    arch, path = gemma
    if backend == "cpu" and CpuKernelBackend.unavailable(CPU) is not None:
        pytest.skip("the C++ kernels are not built here")
    ref = Reference(path)
    batch = prompts()
    want = [ref.greedy(p, MAX_TOKENS) for p in batch]
    with LLM(path, dtype="float32", attention_backend=backend, **tight_for(path)) as llm:
        model = llm.engine.core.executor.worker.runner.model
        windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
        assert windows == [WINDOW, None, WINDOW]   # local, global, local
        assert model.layer_stack is None           # not Llama's layers
        assert generate(llm, batch) == want
        assert llm.get_stats().num_preemptions > 0
        assert generate(llm, batch[2:]) == want[2:]
        assert llm.get_stats().prefix_cache_hits > 0


def test_the_window_and_the_caps_change_the_output(gemma):
    """Without its window (and, in Gemma 2, its attention soft-cap) the same weights give other
    tokens, so the test above holds each of them to transformers. (The final soft-cap keeps the
    argmax: the logprobs test holds it.)"""
    arch, path = gemma
    batch = prompts(2)
    want = [Reference(path).greedy(p, MAX_TOKENS) for p in batch]
    changes = [{"sliding_window": 10_000}]
    if arch == "gemma2":
        changes.append({"attn_logit_softcapping": None})
    for change in changes:
        ref = Reference(path)
        for key, value in change.items():
            setattr(ref.model.config, key, value)
            for layer in ref.model.model.layers:
                if key == "sliding_window" and layer.self_attn.sliding_window is not None:
                    layer.self_attn.sliding_window = value
                elif key == "attn_logit_softcapping":
                    layer.self_attn.attn_logit_softcapping = value
        assert [ref.greedy(p, MAX_TOKENS) for p in batch] != want, change


def test_gemma2_logprobs_are_of_the_soft_capped_logits(tmp_path_factory):
    path = tiny_checkpoint_dir("gemma2", tmp_path_factory, tie_word_embeddings=False)
    ref = Reference(path)
    prompt = prompts(1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", num_kv_blocks=20, block_size=16) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    got = torch.tensor([step[token].logprob for step, token in zip(out.logprobs, ids)])
    with torch.inference_mode():
        logits = ref.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    assert logits.abs().max() <= 30   # transformers' logits are capped at final_logit_softcapping
    want = torch.log_softmax(logits.float(), -1)[torch.arange(len(ids)), torch.tensor(ids)]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gemma3_local_layers_take_their_own_rope_base(tmp_path_factory):
    path = tiny_checkpoint_dir("gemma3", tmp_path_factory, tie_word_embeddings=False)
    hf = Reference(path).model
    with LLM(path, dtype="float32", num_kv_blocks=20, block_size=16) as llm:
        rotary = llm.engine.core.executor.worker.runner.model.model.rotary
        x = torch.zeros(1, 1, 16)
        for position in (0, 7, 500):
            pos = torch.tensor([[position]])
            for ours, layer_type in ((rotary.rotary, "full_attention"), (rotary.local, "sliding_attention")):
                cos, sin = hf.model.rotary_emb(x, pos, layer_type)
                assert torch.allclose(ours.cos[position], cos[0, 0], atol=1e-6)
                assert torch.allclose(ours.sin[position], sin[0, 0], atol=1e-6)
        assert not torch.allclose(rotary.rotary.cos[500], rotary.local.cos[500])


def test_gemma3_soft_caps_no_attention_scores_as_transformers(tmp_path_factory):
    """Gemma3TextConfig has attn_logit_softcapping, but transformers' Gemma 3 attention never
    applies it; treadle capped the scores of such a config and parted at the first token."""
    path = make_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("tiny-gemma3-softcap"),
                                tie_word_embeddings=False, attn_logit_softcapping=5.0)
    ref = Reference(path)
    batch = prompts(3)
    want = [ref.greedy(p, 16) for p in batch]
    # transformers' output does not depend on the field at all.
    ref.model.config.attn_logit_softcapping = None
    for layer in ref.model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert [ref.greedy(p, 16) for p in batch] == want
    with LLM(path, dtype="float32", device="cpu", block_size=16, num_kv_blocks=48) as llm:
        assert greedy_ids(llm, batch, 16) == want
        model = llm.engine.core.executor.worker.runner.model
        assert all(layer.self_attn.attn.logit_softcap is None for layer in model.model.layers)


@pytest.mark.parametrize("pp, tp", [(1, 2), (2, 1)])
def test_split_over_worker_processes_matches_transformers(gemma, pp, tp):
    arch, path = gemma
    ref = Reference(path)
    batch = prompts(3)
    with LLM(path, dtype="float32", pipeline_parallel_size=pp, tensor_parallel_size=tp,
             distributed_executor_backend="mp", **tight_for(path)) as llm:
        assert generate(llm, batch) == [ref.greedy(p, MAX_TOKENS) for p in batch]


def test_gemma3_with_a_vision_tower_is_a_clear_error():
    import transformers

    config = transformers.Gemma3Config()
    with pytest.raises(ValueError, match="model_type 'gemma3_text'"):
        get_model_class(config)
    assert get_model_class(config.text_config).__name__ == "Gemma3ForCausalLM"
