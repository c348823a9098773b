"""The CPU fast paths: oneDNN-packed GEMM weights, the C++ paged decode and prefill kernels,
and the decode-chunk plan of the torch attention path. End-to-end equality with transformers lives in
test_correctness.py."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
import torch.utils.cpp_extension

from tests.kernel_support import CPU, HAS_AMX, needs_kernels
from treadle import LLM, SamplingParams
from treadle.attention.backend import PagedAttention
from treadle.attention.cpu_backend import CpuKernelBackend
from treadle.attention.torch_backend import DECODE_CHUNK_TOKENS, GatherBuffer, TorchBackend
from treadle.kernels import cpu
from treadle.kernels.cpu import cpu_kernels_available
from treadle.models import linear
from treadle.models.llama import RMSNorm
from treadle.models.rope import apply_rope

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


def test_gemm_rows_round_up_by_at_most_a_sixteenth():
    counts = {linear.gemm_rows(r) for r in range(linear.SMALL_ROWS + 1, 2049)}
    assert len(counts) < 100   # kernels oneDNN compiles, against 2,044 row counts
    for rows in range(linear.SMALL_ROWS + 1, 2049):   # at most 7 more, or a sixteenth
        assert rows <= linear.gemm_rows(rows) <= max(rows + 7, rows * 17 / 16)


@needs_packing
@pytest.mark.parametrize("rows", [9, 300, 513])
def test_padded_rows_leave_the_real_rows_alone(rows):
    """The packed GEMM runs at gemm_rows(rows) rows; the rows asked for come back as the GEMM
    at exactly that many rows gives them."""
    torch.manual_seed(rows)
    weight, x = torch.randn(40, 64), torch.randn(rows, 64)
    packed = linear.pack(weight)
    exact = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    out = linear.linear(x, weight, None, packed)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, exact, rtol=1e-6, atol=1e-6)


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
    llm = LLM(tiny_checkpoints["llama"], block_size=16, num_kv_blocks=64)
    runner = llm.engine.core.executor.worker.runner
    gate_up = runner.model.model.layers[0].mlp.gate_up_proj
    assert (gate_up.packed is not None) != (gate_up.bf16x3 is not None)   # oneDNN's copy, or AMX's parts
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
    return TorchBackend(CPU, block_size).build_metadata(q_lens, ctx, ctx.copy(), table), table


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
    # A step budget of 128 (the prompt is 6 tokens): the untied head's GEMM (49,152 rows) is
    # warmed only up to it at start-up.
    llm = LLM(tiny_checkpoints["qwen2"], block_size=16, num_kv_blocks=64, max_num_batched_tokens=128)
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


def _dense_decode(q, k_cache, v_cache, table, seq_lens, scale):
    """Reference: each sequence's K/V laid out densely, attention in float64."""
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = []
    for i, n in enumerate(seq_lens):
        blocks = torch.as_tensor(table[i])
        k = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
# few sequences: the kernel splits by KV head; sequences past 512 tokens are split into parts
@pytest.mark.parametrize("num_seqs", [1, 3, 40])
# 64 and 128 take the AVX-512 path where the CPU has it (16-token tiles across block bounds at
# block size 32 and 8); 40 takes the plain loops everywhere.
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (40, 8)])
def test_native_decode_matches_dense_attention(dtype, tol, heads, kv_heads, num_seqs, head_dim, block_size):
    out, expected = _run_decode(dtype, heads, kv_heads, num_seqs, head_dim, block_size)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def _run_decode(dtype, heads, kv_heads, num_seqs, head_dim, block_size, lens_in_front=None, q_scale=1.0):
    """The decode kernel's output on scattered blocks, and float64 attention's. The first
    sequences are 1,100 tokens long (parts of 512 in the vector kernel, the last short; of
    1,024 on tiles), 1, 513 (a last part of one token), 17, 300, 16 and 33, or `lens_in_front`;
    the rest random."""
    rng = np.random.default_rng(num_seqs)
    num_blocks = 1024 * 16 // block_size
    front = lens_in_front or [1100, 1, 513, 17, 300, 16, 33]
    seq_lens = front[:num_seqs] + [int(x) for x in rng.integers(1, 200, max(0, num_seqs - len(front)))]
    max_blocks = -(-max(seq_lens) // block_size)
    # Scattered blocks, unused table entries on the null block 0, as the runner fills them.
    table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    for i, n in enumerate(seq_lens):
        table[i, :-(-n // block_size)] = [next(free) for _ in range(-(-n // block_size))]
    torch.manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    # q as the model hands it over: a strided view into a fused qkv output.
    qkv = (torch.randn(num_seqs, heads + 2 * kv_heads, head_dim) * q_scale).to(dtype)
    q = qkv[:, :heads]
    out = torch.full((num_seqs, heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    expected = _dense_decode(q, k_cache, v_cache, table, seq_lens, scale)
    # Slots past a sequence's end hold whatever was there: the kernel must not read them.
    for i, n in enumerate(seq_lens):
        if n % block_size:
            k_cache[table[i, n // block_size], n % block_size:] = float("nan")
            v_cache[table[i, n // block_size], n % block_size:] = float("nan")
    torch.ops.treadle.paged_decode_attention(out, q, k_cache, v_cache, torch.from_numpy(table),
                                             torch.tensor(seq_lens, dtype=torch.int32), scale)
    return out, expected


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_of_a_sequence_does_not_depend_on_its_batch(dtype):
    """A long sequence's parts follow its length alone: alone (an item per KV head and part) or
    beside 39 others (a part's KV heads in one item), its 1,500 tokens give the same bits."""
    torch.manual_seed(0)
    seq_lens = torch.tensor([1500] + [100] * 39, dtype=torch.int32)
    k_cache, v_cache = (torch.randn(96 * 40, 16, 3, 64).to(dtype) for _ in range(2))
    table = torch.randperm(96 * 40, dtype=torch.int32).reshape(40, 96)
    q = torch.randn(40, 9, 64).to(dtype)
    outs = [torch.empty(n, 9, 64, dtype=dtype) for n in (40, 1)]
    for out in outs:
        n = out.shape[0]
        torch.ops.treadle.paged_decode_attention(out, q[:n], k_cache, v_cache, table[:n], seq_lens[:n], 0.125)
    assert torch.equal(outs[0][0], outs[1][0])


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4), (32, 2), (34, 2)])
@pytest.mark.parametrize("num_seqs", [3, 40])   # 3: an item per KV head; 40: a sequence's heads together
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (128, 64), (32, 128), (8, 64)])
def test_native_decode_bf16_on_amx_tiles_and_vectors(monkeypatch, heads, kv_heads, num_seqs, block_size, head_dim):
    """bf16 decode on a CPU with AMX runs on tiles when a KV head has at most 16 query heads
    and a block a multiple of 16 tokens (TREADLE_AMX=0: the vector kernel). Both match float64
    attention; on tiles P is rounded to bf16, so there the two differ in their last bits, and
    elsewhere the switch changes nothing."""
    outs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("TREADLE_AMX", switch)
        outs[switch], expected = _run_decode(torch.bfloat16, heads, kv_heads, num_seqs, head_dim, block_size)
        torch.testing.assert_close(outs[switch].double(), expected, rtol=2e-2, atol=2e-2)
    on_tiles = HAS_AMX and heads // kv_heads <= 16 and block_size % 16 == 0
    assert torch.equal(outs["1"], outs["0"]) != on_tiles


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152 + 5])
def test_native_argmax_answers_as_torch_does(vocab, dtype):
    """Ties go to the first index, -inf masks and an all -inf row work, a NaN wins at its
    first place (as in torch), the vocab's tail past 16 lanes counts, rows may be strided;
    bf16 and fp16 rows answer as their fp32 widening does."""
    torch.manual_seed(vocab)
    wide = torch.randn(9, vocab + 7).to(dtype)
    logits = wide[:, :vocab]                       # rows 7 floats apart beyond the vocab
    logits[1] = float("-inf")
    logits[2, vocab // 2:] = float("-inf")
    logits[3] = logits[3].round()                  # many ties at the top
    logits[4, -1] = 1e9                            # the maximum in the tail
    logits[5, vocab // 3] = float("nan")
    logits[5, -1] = float("nan")
    logits[6, ::2] = 5.0                           # a tie between the first and later lanes
    logits[7, -1] = float("nan")
    logits[8] = 0.0
    logits[8, -1] = -0.0
    assert torch.equal(torch.ops.treadle.argmax_rows(logits), logits.float().argmax(dim=-1))


@needs_kernels
def test_native_argmax_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        torch.ops.treadle.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.treadle.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="empty row"):
        torch.ops.treadle.argmax_rows(torch.zeros(2, 0))


@needs_kernels
def test_native_decode_refuses_bad_inputs():
    k_cache = torch.zeros(4, 16, 2, 8)
    q, out = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.treadle.paged_decode_attention(out, q, k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int64),
                                                 torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        torch.ops.treadle.paged_decode_attention(torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), k_cache, k_cache,
                                                 torch.zeros(1, 1, dtype=torch.int32),
                                                 torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="does not fit its block table"):   # one block of 16 slots
        torch.ops.treadle.paged_decode_attention(out, q, k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
                                                 torch.full((1,), 17, dtype=torch.int32), 1.0)


@needs_kernels
def test_engine_runs_the_kernels_unless_switched_off(tiny_checkpoints, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 17)]
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("TREADLE_CPU_KERNELS", switch)
        # The prompts (62 tokens) fit one step of 128 as they did the default 2,048; the untied
        # head's GEMM (49,152 rows) is warmed only up to the budget at start-up.
        llm = LLM(tiny_checkpoints["qwen2"], block_size=16, num_kv_blocks=64, max_num_batched_tokens=128)
        runner = llm.engine.core.executor.worker.runner
        assert runner.native_kernels == (switch == "1")
        assert runner.attention.name == ("cpu" if switch == "1" else "torch")
        assert runner.model.model.layers[0].mlp.native == (switch == "1")
        runs[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["1"] == runs["0"]


def _paged_prefill_case(spans, heads, kv_heads, block_size, dtype, head_dim=64, seed=0, q_scale=1.0):
    """A cache with scattered blocks and the spans' (context, query) K/V in it, every other
    slot NaN: a kernel that reads past a span's keys shows it. q is a strided view into a
    fused qkv tensor, as the model hands it over."""
    rng = np.random.default_rng(seed)
    num_blocks = 512
    totals = [ctx + n for ctx, n in spans]
    max_blocks = -(-max(totals) // block_size)
    table = np.zeros((len(spans), max_blocks), dtype=np.int32)
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    torch.manual_seed(seed)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for i, total in enumerate(totals):
        table[i, :-(-total // block_size)] = [next(free) for _ in range(-(-total // block_size))]
        t = np.arange(total)
        slots = torch.from_numpy((table[i, t // block_size] * block_size + t % block_size).astype(np.int64))
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(total, kv_heads, head_dim).to(dtype)
    num_tokens = sum(n for _, n in spans)
    q = (torch.randn(num_tokens, heads + 2 * kv_heads, head_dim) * q_scale).to(dtype)[:, :heads]
    query_start = np.concatenate([[0], np.cumsum([n for _, n in spans])]).astype(np.int32)
    return q, k_cache, v_cache, table, query_start


def _dense_prefill(q, k_cache, v_cache, table, query_start, context_lens, scale):
    """Reference: each span's K/V laid out densely, a bottom-right causal mask, float64."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, ctx in enumerate(context_lens):
        a, b = int(query_start[i]), int(query_start[i + 1])
        total = ctx + b - a
        blocks = torch.as_tensor(table[i])
        k = k_cache[blocks].flatten(0, 1)[:total].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:total].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[a:b].double(), k) * scale
        visible = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)
    return out


# (context, queries): no context, one query, long and short chunks after a context, a
# speculative verification's 1 + k tokens, an empty span.
PREFILL_SPANS = [(0, 37), (0, 1), (300, 4), (17, 1), (5, 100), (0, 0), (64, 20), (1000, 70), (3, 5)]


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (4, 2)])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 64), (8, 64), (16, 40)])
def test_native_prefill_matches_dense_attention(dtype, tol, heads, kv_heads, block_size, head_dim):
    """Block sizes that hold whole 16-key tiles (fp32 reads them in place) and one that does
    not; a head_dim that is not a multiple of 16 (the transposes' leftover path)."""
    out, expected = _run_prefill(PREFILL_SPANS, heads, kv_heads, block_size, dtype, head_dim)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def _run_prefill(spans, heads, kv_heads, block_size, dtype, head_dim, q_scale=1.0):
    """The kernel's output for the spans (context, queries), and float64 attention's."""
    q, k_cache, v_cache, table, query_start = _paged_prefill_case(spans, heads, kv_heads, block_size, dtype, head_dim,
                                                                  q_scale=q_scale)
    context_lens = [ctx for ctx, _ in spans]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    torch.ops.treadle.paged_prefill_attention(
        out, q, k_cache, v_cache, torch.from_numpy(table), torch.from_numpy(query_start),
        torch.tensor(context_lens, dtype=torch.int32), scale)
    return out, _dense_prefill(q, k_cache, v_cache, table, query_start, context_lens, scale)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 64), (32, 128)])
def test_native_prefill_bf16_on_amx_tiles_and_vectors(monkeypatch, heads, kv_heads, block_size, head_dim):
    """bf16 prefill on a CPU with AMX runs on tiles (TREADLE_AMX=0: the vector kernel). Both
    match float64 attention; on tiles P is rounded to bf16, so where the CPU has AMX the two
    differ in their last bits, and elsewhere the switch changes nothing."""
    outs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("TREADLE_AMX", switch)
        outs[switch], expected = _run_prefill(PREFILL_SPANS, heads, kv_heads, block_size, torch.bfloat16, head_dim)
        torch.testing.assert_close(outs[switch].double(), expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(outs["1"], outs["0"]) != HAS_AMX


@needs_kernels
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 8)])
def test_attention_holds_with_scores_far_apart(head_dim, block_size):
    """Queries 50x the usual size put a row's scores hundreds apart, so the softmax's exp
    arguments go far below -88, where fp32 underflows (the SiLU's scalar path once took its
    exp past the other end, into NaN, under -ffast-math on a CPU without AVX-512)."""
    out, expected = _run_decode(torch.float32, 9, 3, 8, head_dim, block_size, q_scale=50.0)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    out, expected = _run_prefill(PREFILL_SPANS, 9, 3, block_size, torch.float32, head_dim, q_scale=50.0)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)


@needs_kernels
def test_native_prefill_refuses_bad_inputs():
    k_cache = torch.zeros(4, 16, 2, 8)
    q, out = torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)
    table = torch.ones(1, 1, dtype=torch.int32)
    starts, ctx = torch.tensor([0, 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    op = torch.ops.treadle.paged_prefill_attention
    with pytest.raises(RuntimeError, match="int32"):
        op(out, q, k_cache, k_cache, table.long(), starts, ctx, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        op(torch.zeros(3, 3, 8), torch.zeros(3, 3, 8), k_cache, k_cache, table, starts, ctx, 1.0)
    with pytest.raises(RuntimeError, match="block table"):   # 14 + 3 tokens, one block of 16
        op(out, q, k_cache, k_cache, table, starts, torch.tensor([14], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="per span"):
        op(out, q, k_cache, k_cache, table, torch.tensor([0, 1, 3], dtype=torch.int32), ctx, 1.0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_matches_the_torch_path(dtype):
    """One step of decodes and prefill chunks through the `cpu` backend (the kernels) and the
    `torch` backend: the same output, and the same K/V written to the cache."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    ctx = np.array([700, 300, 41, 0, 200, 1000, 0])
    q_lens = np.array([1, 1, 1, 30, 5, 64, 1])          # three decodes first, then prefills
    rng = np.random.default_rng(1)
    max_blocks = -(-int((ctx + q_lens).max()) // block_size)
    table = rng.permutation(np.arange(1, 1 + len(ctx) * max_blocks)).reshape(len(ctx), max_blocks)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    torch.manual_seed(0)
    kv_cache = torch.randn(2, table.size + 1, block_size, kv_heads, head_dim).to(dtype)
    qkv = torch.randn(int(q_lens.sum()), heads + 2 * kv_heads, head_dim).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    outs, caches = [], []
    for backend in (CpuKernelBackend(CPU, block_size), TorchBackend(CPU, block_size)):
        meta = backend.build_metadata(q_lens, ctx, positions, table)
        assert meta.num_decodes == 3
        cache = kv_cache.clone()
        outs.append(attn(q, k, v, cache, meta))
        caches.append(cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    assert torch.equal(caches[0], caches[1])


FUSED_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


@needs_kernels
@pytest.mark.parametrize("dtype", list(FUSED_TOLERANCE))
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_fused_ops_match_the_torch_expressions(dtype, rows):
    """Each fused op against the transformers-style torch code it stands in for, on strided
    inputs as the model hands them over."""
    torch.manual_seed(rows)
    tol = FUSED_TOLERANCE[dtype]

    # 100 columns: six 16-lane vectors and a scalar tail; gates out to where exp overflows
    gate_up = torch.randn(rows, 2 * 100).mul(4).to(dtype)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -87.5, -0.0, 0.0, 87.5, 90.0, 200.0])
    gate, up = gate_up.split(100, dim=-1)
    torch.testing.assert_close(torch.ops.treadle.silu_and_mul(gate_up),
                               torch.nn.functional.silu(gate) * up, rtol=tol, atol=tol)
    gate_up[0, 1] = float("nan")
    assert torch.ops.treadle.silu_and_mul(gate_up)[0, 1].isnan()

    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    for x in (torch.randn(rows, 64).to(dtype),                   # a residual stream
              torch.randn(rows, 7, 64).to(dtype)[:, 1:5]):      # q heads inside a qkv row
        torch.testing.assert_close(torch.ops.treadle.rms_norm(x, norm.weight, norm.eps), norm(x),
                                   rtol=tol, atol=tol)

    # The residual add before a norm: the same bits as the add and the norm apart, which the
    # layer stack's output must match.
    out = torch.randn(rows, 64).to(dtype)
    residual = torch.randn(rows, 2, 64).to(dtype)[:, 0]   # rows apart, as a strided view
    total, normed = torch.ops.treadle.add_rms_norm(out, residual, norm.weight, norm.eps)
    assert torch.equal(total, out + residual)
    assert torch.equal(normed, torch.ops.treadle.rms_norm(out + residual, norm.weight, norm.eps))
    torch.testing.assert_close(normed, norm(out + residual), rtol=tol, atol=tol)

    qkv = torch.randn(rows, 7, 64).to(dtype)
    cos, sin = torch.randn(rows, 1, 64).to(dtype), torch.randn(rows, 1, 64).to(dtype)
    expected = apply_rope(qkv[:, :5], cos, sin)
    untouched = qkv[:, 5:].clone()
    torch.ops.treadle.rope_(qkv[:, :5], cos, sin)
    if dtype == torch.float32:   # same products and sums, rounded the same way: bit for bit
        assert torch.equal(qkv[:, :5], expected)
    torch.testing.assert_close(qkv[:, :5], expected, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, 5:], untouched)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_what_index_copy_stores(dtype):
    """Each token's K and V into its slot, read from a qkv row as the model hands them over;
    every other slot untouched."""
    torch.manual_seed(0)
    cache = torch.randn(2, 6, 16, 3, 64).to(dtype)
    qkv = torch.randn(20, 15 * 64).to(dtype)
    k, v = qkv[:, 9 * 64:12 * 64].view(20, 3, 64), qkv[:, 12 * 64:].view(20, 3, 64)
    slots = torch.randperm(6 * 16)[:20]
    expected = cache.clone()
    expected[0].view(-1, 3, 64).index_copy_(0, slots, k)
    expected[1].view(-1, 3, 64).index_copy_(0, slots, v)
    torch.ops.treadle.write_kv_(cache, k, v, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.treadle.write_kv_(cache, k[:1], v[:1], torch.tensor([6 * 16]))
    with pytest.raises(RuntimeError, match="one int64 slot per token"):
        torch.ops.treadle.write_kv_(cache, k, v, slots.int())


@needs_kernels
def test_fused_ops_refuse_bad_inputs():
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        torch.ops.treadle.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.treadle.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        torch.ops.treadle.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="cos/sin"):
        torch.ops.treadle.rope_(torch.zeros(2, 3, 8), torch.zeros(1, 8), torch.zeros(1, 8))


def test_build_name_follows_the_torch_installation(monkeypatch, tmp_path):
    """Two venvs with the same torch version keep separate builds; a symlinked path is the same
    installation."""
    name = cpu.build_name()
    torch_dir = os.path.dirname(torch.__file__)
    (tmp_path / "link").symlink_to(torch_dir)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "link" / "__init__.py"))
    assert cpu.build_name() == name
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpu.build_name() != name


@pytest.mark.parametrize("required", [False, True])
def test_a_failed_build_falls_back_unless_required(monkeypatch, tmp_path, caplog, required):
    def no_compiler(**kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu, "_loaded", None)   # as in a fresh process
    monkeypatch.setenv("TREADLE_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("TREADLE_CPU_KERNELS", raising=False)
    if required:
        monkeypatch.setenv("TREADLE_REQUIRE_CPU_KERNELS", "1")
        with pytest.raises(RuntimeError, match="TREADLE_REQUIRE_CPU_KERNELS=1.*no compiler here"):
            cpu_kernels_available(CPU)
    else:
        monkeypatch.delenv("TREADLE_REQUIRE_CPU_KERNELS", raising=False)
        with caplog.at_level(logging.WARNING, logger="treadle.kernels.cpu"):
            assert cpu_kernels_available(CPU) is False
        assert "slower torch path: no compiler here" in caplog.text
