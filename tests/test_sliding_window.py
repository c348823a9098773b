"""Sliding-window attention and soft-capped scores: both attention backends (the C++ kernels and
torch) against dense attention for every layout a step has (decodes, some split into parts;
prefill chunks with and without a cached prefix), and a tiny Mistral whose 24-token window is
far shorter than its prompts token-identical to transformers through batching, chunked prefill,
preemption and prefix hits, on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernel_support import CPU, needs_kernels
from tests.family_support import MAX_TOKENS, TIGHT, PretrainedReference as Reference, greedy_ids
from tests.family_support import random_prompts
from tests.tiny_models import make_tiny_checkpoint
from treadle import LLM
from treadle.attention.backend import PagedAttention, create_attention_backend
from treadle.attention.cpu_backend import CpuKernelBackend

BLOCK = 16
# Decodes (one new token after a context; 1100 is split into parts by the decode kernel), then
# prefill chunks after a context, and a whole prompt.
LAYOUT = [(1, 1100), (1, 70), (1, 9), (37, 50), (5, 300), (40, 0)]


def dense(q, k, v, q_pos, scale, window, softcap):
    """q [Tq, Hq, D] at positions q_pos against k/v [Tk, Hkv, D] at 0..Tk-1, in fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(k.shape[0])
    mask = key_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def run_layout(backend_name: str, dtype: torch.dtype, head_dim: int, window: int | None,
               softcap: float | None) -> None:
    gen = torch.Generator().manual_seed(0)
    hq, hkv = 4, 2
    layer = PagedAttention(hq, hkv, head_dim, head_dim ** -0.5, window, softcap)
    max_blocks = max(-(-(n + c) // BLOCK) for n, c in LAYOUT)
    num_blocks = 1 + len(LAYOUT) * max_blocks
    cache = torch.randn(2, num_blocks, BLOCK, hkv, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen).numpy() + 1
    table = perm.reshape(len(LAYOUT), max_blocks).astype(np.int32)
    q_lens = np.array([n for n, _ in LAYOUT])
    ctx = np.array([c for _, c in LAYOUT])
    positions = np.concatenate([np.arange(c, c + n) for n, c in LAYOUT])
    total = int(q_lens.sum())
    q = torch.randn(total, hq, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, hkv, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, hkv, head_dim, generator=gen).to(dtype)
    backend = create_attention_backend(backend_name, CPU, BLOCK)
    meta = backend.build_metadata(q_lens, ctx, positions, table)
    out = layer(q, k, v, cache, meta).view(total, hq, head_dim)
    start = 0
    for r, (n, c) in enumerate(LAYOUT):
        slots = [table[r, t // BLOCK] * BLOCK + t % BLOCK for t in range(c + n)]
        keys = cache[0].view(-1, hkv, head_dim)[slots]
        values = cache[1].view(-1, hkv, head_dim)[slots]
        want = dense(q[start:start + n], keys, values, torch.arange(c, c + n), layer.scale, window, softcap)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol,
                                   msg=f"request {r} ({n} after {c})")
        start += n


WINDOWS = [None, 1, 5, 24, 40, 600]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_backend_keeps_windows_and_caps(window, softcap):
    run_layout("torch", torch.float32, 16, window, softcap)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])   # the plain loops, and the AVX-512 ones
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_kernels_keep_windows_and_cap(dtype, head_dim, window, softcap):
    run_layout("cpu", dtype, head_dim, window, softcap)


# -- a tiny Mistral whose window is shorter than its prompts ---------------------------------

WINDOW = 24


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return make_tiny_checkpoint("mistral", tmp_path_factory.mktemp("tiny-mistral-window"),
                                tie_word_embeddings=False, sliding_window=WINDOW)


def prompts(n: int = 4) -> list[list[int]]:
    return random_prompts(n, 30, seed=5)


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return greedy_ids(llm, batch)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mistral_with_a_short_window_matches_transformers(mistral, backend):
    if backend == "cpu" and CpuKernelBackend.unavailable(CPU) is not None:
        pytest.skip("the C++ kernels are not built here")
    ref = Reference(mistral)
    batch = prompts()
    want = [ref.greedy(p, MAX_TOKENS) for p in batch]
    # The same weights attending to every token give other tokens: the window matters here.
    full = Reference(mistral)
    full.model.config.sliding_window = None
    assert [full.greedy(p, MAX_TOKENS) for p in batch] != want
    # Blocks behind the window go back to the pool as requests run (tests/test_window_eviction.py),
    # so the four requests fit TIGHT's 13 blocks: 8 still make them preempt.
    with LLM(mistral, dtype="float32", attention_backend=backend, **{**TIGHT, "num_kv_blocks": 9}) as llm:
        model = llm.engine.core.executor.worker.runner.model
        assert all(layer.self_attn.attn.sliding_window == WINDOW for layer in model.model.layers)
        assert model.layer_stack is not None   # it runs the cpu backend's steps, windows and all
        assert generate(llm, batch) == want
        assert llm.get_stats().num_preemptions > 0
        assert generate(llm, batch[2:]) == want[2:]
        assert llm.get_stats().prefix_cache_hits > 0


def test_an_explicit_max_model_len_past_the_blocks_is_taken_when_every_layer_is_windowed(mistral):
    """A request of a model whose every layer is windowed holds only its window's blocks, so
    any length fits: an explicit max_model_len past the blocks was refused before the model
    loaded, though the engine serves it (and did, with max_model_len unset)."""
    prompt = prompts(1)[0]
    new = 140 - len(prompt)   # past the 8 blocks' 128 tokens
    with LLM(mistral, dtype="float32", max_model_len=512,
             **{**TIGHT, "num_kv_blocks": 9, "max_num_seqs": 1}) as llm:
        assert llm.engine.core.config.model.max_model_len == 512
        assert greedy_ids(llm, [prompt], new) == [Reference(mistral).greedy(prompt, new)]
