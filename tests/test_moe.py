"""Mixture-of-experts models (treadle/models/moe.py): Qwen3-MoE and Mixtral, greedy fp32 output
token-identical to transformers' own MoE implementation loading the same folder, through
batching, chunked prefill, preemption, prefix hits, weight updates in transformers 5's stacked
form, and tensor and pipeline parallelism over worker processes."""

from __future__ import annotations

import pytest
import torch

from tests.family_support import TIGHT, PretrainedReference as Reference, greedy_ids
from tests.family_support import random_prompts
from tests.tiny_models import MOE_ARCHS, tiny_checkpoint_dir
from treadle import LLM
from treadle.models.moe import SparseMoeBlock

MAX_TOKENS = 16
TIGHT = {**TIGHT, "num_kv_blocks": 10}


def prompts(n: int = 4) -> list[list[int]]:
    """Distinct prompts of 9 to 60 tokens: up to four 16-token chunks each."""
    return random_prompts(n, 9, seed=7)


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return greedy_ids(llm, batch, MAX_TOKENS)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory) -> tuple[str, str]:
    arch = request.param
    return arch, tiny_checkpoint_dir(arch, tmp_path_factory, tie_word_embeddings=False)


def test_batched_chunked_preempted_and_prefix_hits_match_transformers(moe):
    arch, path = moe
    ref = Reference(path)
    batch = prompts()
    want = [ref.greedy(p, MAX_TOKENS) for p in batch]
    with LLM(path, dtype="float32", **TIGHT) as llm:
        routed = _record_routing(llm)
        assert generate(llm, batch) == want
        assert llm.get_stats().num_preemptions > 0   # the cache forced some
        # The same prompts again: their full blocks are prefix hits now.
        assert generate(llm, batch[:2]) == want[:2]
        assert llm.get_stats().prefix_cache_hits > 0
    # Tokens of one step pick different experts, and a token's choice changes across layers:
    # a model that routed every token alike, or every layer alike, could not pass.
    layers = sorted(routed)
    assert all(len({tuple(row) for row in routed[i][0].tolist()}) > 1 for i in layers)
    first, last = routed[layers[0]][0], routed[layers[-1]][0]
    assert not torch.equal(first.sort(dim=-1).values, last.sort(dim=-1).values)


def test_qwen3_moe_mixes_dense_and_sparse_layers(tmp_path_factory):
    path = tiny_checkpoint_dir("qwen3_moe", tmp_path_factory, tie_word_embeddings=False)
    with LLM(path, dtype="float32", **TIGHT) as llm:
        model = _model(llm)
        kinds = [type(model.model.layers[i].mlp).__name__ for i in range(3)]
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]   # mlp_only_layers=[1]


def test_stacked_expert_updates_match_transformers_and_restore(moe):
    """A trainer on transformers 5 sends its named_parameters: every expert of a layer in one
    stacked tensor. The update reaches every expert; the originals bring the output back."""
    arch, path = moe
    ref = Reference(path)
    params = dict(ref.model.named_parameters())
    stacked = [n for n in params if n.endswith("mlp.experts.gate_up_proj")][0]
    router = stacked.replace("experts.gate_up_proj", "gate.weight")
    gen = torch.Generator().manual_seed(3)
    originals = {n: params[n].detach().clone() for n in (stacked, router)}
    perturbed = {n: t + 0.3 * t.std() * torch.randn(t.shape, generator=gen) for n, t in originals.items()}
    batch = prompts(3)
    # The batch (78 tokens) fits one step of 128 as it did the default 2,048; the untied head's
    # GEMM (49,152 rows) is warmed only up to the budget at start-up.
    with LLM(path, dtype="float32", block_size=16, num_kv_blocks=32,
             max_num_batched_tokens=128) as llm:
        before = generate(llm, batch)
        llm.update_weights(list(perturbed.items()))
        after = generate(llm, batch)
        llm.update_weights(list(originals.items()))
        restored = generate(llm, batch)
        with pytest.raises(ValueError, match="shape"):
            llm.update_weights([(stacked, originals[stacked][:, :-2])])
    assert after != before
    assert after == [Reference(path, perturbed).greedy(p, MAX_TOKENS) for p in batch]
    assert restored == before == [ref.greedy(p, MAX_TOKENS) for p in batch]


@pytest.mark.parametrize("arch, pp, tp", [("qwen3_moe", 1, 2), ("mixtral", 2, 1)])
def test_experts_split_over_worker_processes_match_transformers(tmp_path_factory, arch, pp, tp):
    """TP: every rank holds half of every expert's features, one all-reduce per block. PP: the
    stages hold different layers' experts."""
    path = tiny_checkpoint_dir(arch, tmp_path_factory, tie_word_embeddings=False)
    ref = Reference(path)
    batch = prompts(3)
    with LLM(path, dtype="float32", pipeline_parallel_size=pp, tensor_parallel_size=tp,
             distributed_executor_backend="mp", async_scheduling=True, **TIGHT) as llm:
        assert generate(llm, batch) == [ref.greedy(p, MAX_TOKENS) for p in batch]


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.executor.worker.runner.model


def _record_routing(llm: LLM) -> dict[int, list[torch.Tensor]]:
    """Each sparse layer's chosen experts [tokens, k], step by step."""
    routed: dict[int, list[torch.Tensor]] = {}
    model = _model(llm)
    for index, layer in enumerate(model.model.layers):
        block = getattr(layer, "mlp", None)
        if isinstance(block, SparseMoeBlock):
            route = block.route

            def recording(x, index=index, route=route):
                weights, experts = route(x)
                routed.setdefault(index, []).append(experts.clone())
                return weights, experts
            block.route = recording
    return routed
