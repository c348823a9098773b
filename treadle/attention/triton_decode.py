"""Split-KV decode attention in Triton: for a few long sequences, where one program per (sequence,
KV head) would leave most of the GPU idle.

Each decode's keys are cut into up to `num_splits` ranges, one program per (sequence, KV head,
range) with every query head of the group as its rows; each writes its range's normalised
output and log-sum-exp (base 2), and a second kernel merges the ranges. The ranges come from
each sequence's length on the device: a sequence takes one range per `min_tokens` keys, at
least one and at most num_splits, so a short sequence beside long ones is not cut into slivers
and a CUDA graph captured at the largest count serves every length. The grid (num_decodes, Hkv,
num_splits) is fixed by the host's counts alone; a range a sequence does not use writes an
empty partial. (SGLang's Triton decode kernel has the same two stages.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.attention.triton_unified import (LOG2E, TILE_N, dot_in_fp32, load_kv_tile,
                                              next_tile_blocks, tile_blocks,
                                              online_softmax_step, tile_sizes)


@triton.jit
def _split_decode_kernel(
        part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
        scale_log2, num_splits, min_tokens,
        stride_qt, stride_qh, stride_qd, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr,
        FP32_DOT: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    ranges = tl.minimum(tl.maximum(seq_len // min_tokens, 1), num_splits)
    # Whole tiles per range, so that only a sequence's last range has a partial tile.
    per_split = tl.cdiv(tl.cdiv(seq_len, ranges), TILE_N) * TILE_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], tl.float32)
    tables = block_table_ptr + seq.to(tl.int64) * stride_bt
    first = start + tl.arange(0, TILE_N)
    carried = tile_blocks(tables, first, first < end, BLOCK_SIZE)
    for tile in range(start, end, TILE_N):
        key_pos = tile + tl.arange(0, TILE_N)
        key_ok = key_pos < end
        blocks, carried = next_tile_blocks(carried, tables, key_pos, end, TILE_N, BLOCK_SIZE, True)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, key_pos, key_ok, kv_head, dims,
                            dim_ok, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
                            stride_vh, BLOCK_SIZE)
        m_i, l_i, acc = online_softmax_step(q, k, v, key_ok[None, :], m_i, l_i, acc, scale_log2,
                                            FP32_DOT)

    # An empty range (past the sequence's end) leaves l_i 0: its lse is -inf, its weight 0.
    nonempty = l_i > 0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    part = seq * stride_pt + head * stride_ph + split * stride_ps
    tl.store(part_out_ptr + part[:, None] + dims[None, :], acc,
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + seq * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, num_splits,
                         stride_ot, stride_oh, stride_od, stride_pt, stride_ph, stride_ps,
                         stride_lt, stride_lh,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_lt + head * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))   # the first range is never empty: max is finite
    part = tl.load(part_out_ptr + seq * stride_pt + head * stride_ph + splits[:, None] * stride_ps
                   + dims[None, :],
                   mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    acc = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims * stride_od,
             acc.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def split_kv_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, num_splits: int, min_tokens: int = 1) -> None:
    """Decode attention, one query token per sequence, its keys cut into one range per
    `min_tokens` keys, at least one and at most `num_splits`.

    out, q: [num_seqs, Hq, D] (any strides); the cache, block_table and seq_lens as
    for unified_attention.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_h, _, head_dim_pad = tile_sizes(group, head_dim)   # rows: the group's heads
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_out, part_lse, q, k_cache, v_cache, block_table, seq_lens,
        scale * LOG2E, num_splits, max(1, min_tokens),
        *q.stride(), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h, TILE_N=TILE_N,
        FP32_DOT=dot_in_fp32(q.dtype))
    _merge_splits_kernel[(num_seqs, num_heads)](
        out, part_out, part_lse, num_splits,
        *out.stride(), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits))
