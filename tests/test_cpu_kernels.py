"""The CPU fast paths: oneDNN-packed GEMM weights and the decode-chunk plan of the torch
attention backend. End-to-end equality with transformers lives in test_correctness.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.attention.torch_backend import DECODE_CHUNK_TOKENS, GatherBuffer, build_metadata
from treadle.models import linear

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not linear.packing_supported(CPU), reason="no oneDNN in this torch")


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(0)
    layer = linear.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert linear.pack_weights(layer, CPU) == 1
    assert layer.packed is not None
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@needs_packing
def test_packed_copy_follows_pack_weights_only():
    """The packed copy is a snapshot: an edit to the weight shows once it is packed again."""
    torch.manual_seed(0)
    layer = linear.Linear(32, 48, bias=False)
    x = torch.randn(4, 32)
    linear.pack_weights(layer, CPU)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x), before)          # stale until re-packed
    linear.pack_weights(layer, CPU)
    torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
    linear.unpack_weights(layer)
    assert layer.packed is None
    torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)


def test_no_packing_off_cpu():
    layer = linear.Linear(8, 8)
    assert linear.pack_weights(layer, torch.device("meta")) == 0
    assert layer.packed is None


@needs_packing
def test_engine_repacks_after_weight_update(tiny_checkpoints):
    """update_weights goes through the packed GEMMs: zeroing the head changes every token."""
    llm = LLM(tiny_checkpoints["llama"], num_kv_blocks=64)
    runner = llm.engine.core.executor.worker.runner
    assert runner.model.model.layers[0].mlp.gate_up_proj.packed is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 13, 17, 21]}]
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    head = "lm_head.weight" if runner.model.lm_head is not None else "model.embed_tokens.weight"
    weight = dict(runner.model.named_parameters())[head].detach().clone()
    weight[:, :] = 0
    weight[3, :] = 1      # every hidden state now scores token 3 highest (or ties at 0)
    llm.update_weights([(head, weight)])
    after = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert after != before


def _decode_metadata(seq_lens: list[int], block_size: int = 16):
    ctx = np.array(seq_lens, dtype=np.int64) - 1
    q_lens = np.ones(len(seq_lens), dtype=np.int64)
    max_blocks = -(-max(seq_lens) // block_size)
    table = np.arange(1, 1 + len(seq_lens) * max_blocks, dtype=np.int64).reshape(len(seq_lens), max_blocks)
    return build_metadata(q_lens, ctx, ctx.copy(), table, block_size, CPU, GatherBuffer()), table


def _rows(chunk) -> list[int]:
    return list(range(chunk.rows.start, chunk.rows.stop))


def test_decode_chunks_cover_every_row_once_longest_first():
    rng = np.random.default_rng(0)
    # Longest first, as the model runner sends them.
    seq_lens = sorted((int(x) for x in rng.integers(1, 1500, 70)), reverse=True)
    meta, table = _decode_metadata(seq_lens)
    rows = [r for chunk in meta.decode_chunks for r in _rows(chunk)]
    assert sorted(rows) == list(range(len(seq_lens)))
    lens_in_order = [seq_lens[r] for r in rows]
    assert lens_in_order == sorted(seq_lens, reverse=True)
    for chunk in meta.decode_chunks:
        n = len(_rows(chunk))
        padded = chunk.mask.shape[-1]
        assert n == chunk.mask.shape[0]
        assert n == 1 or n * padded <= DECODE_CHUNK_TOKENS
        assert chunk.block_ids.shape[0] * 16 == n * padded
        for i, r in enumerate(_rows(chunk)):
            assert int(chunk.mask[i].sum()) == seq_lens[r]
            blocks = chunk.block_ids.view(n, -1)[i]
            used = -(-seq_lens[r] // 16)
            assert blocks[:used].tolist() == table[r, :used].tolist()


def test_decodes_out_of_length_order_are_refused():
    with pytest.raises(AssertionError, match="longest first"):
        _decode_metadata([20, 300, 5])


def test_gather_buffer_grows_and_is_reused():
    cache = torch.zeros(10, 16, 2, 8)
    buf = GatherBuffer()
    k1, v1 = buf.take(cache, 3)
    assert k1.shape == (3, 16, 2, 8) and v1.shape == (3, 16, 2, 8)
    k2, _ = buf.take(cache, 2)
    assert k2.data_ptr() == k1.data_ptr()        # smaller request: same storage
    k3, _ = buf.take(cache, 6)
    assert k3.shape == (6, 16, 2, 8)
    k4, _ = buf.take(cache.double(), 1)
    assert k4.dtype == torch.float64             # another dtype: a fresh buffer


@needs_packing
def test_model_load_weights_through_collective_rpc_repacks(tiny_checkpoints):
    """RL frameworks load weights from a worker-side function; the packed GEMMs follow."""
    llm = LLM(tiny_checkpoints["qwen2"], num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [7, 11, 13, 17, 19, 23]}]
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    name = "model.layers.0.mlp.down_proj.weight"
    original = llm.collective_rpc(lambda w: dict(w.runner.model.named_parameters())[name].detach().clone())[0]

    def load(worker, tensor):
        return len(worker.runner.model.load_weights([(name, tensor)], strict=False))

    assert llm.collective_rpc(load, args=(original * 50,)) == [1]
    changed = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.collective_rpc(load, args=(original,)) == [1]
    restored = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert changed != before
    assert restored == before
