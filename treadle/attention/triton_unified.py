"""One Triton kernel for a whole step's paged attention: decodes, prefill chunks over a cached
prefix and 1 + k draft verification, in one launch.

Each program takes one block of up to BLOCK_Q query tokens of one sequence and one KV head,
with every query head of that KV head's group: its tile holds BLOCK_M = BLOCK_Q * group rows,
one per (token, head), so a K/V tile is loaded once per group (GQA). It walks the sequence's
keys through the block table in tiles of TILE_N, causal within the chunk (bottom-right: the
chunk's token i sees context + i + 1 keys), with an online softmax in fp32.

The grid is an upper bound known from shapes alone: sequence s's query blocks are numbered from
query_start[s] // BLOCK_Q + s (enough room for ceil(q_len / BLOCK_Q) blocks), so
num_tokens // BLOCK_Q + num_seqs covers every sequence. Each program finds its sequence by a
binary search of query_start on the device and returns early if its block is past the
sequence's query: no query length comes back to the host. (vLLM's unified Triton attention
numbers its blocks the same way.)

Dots accumulate in fp32. bf16 and fp16 inputs go to them as they are; fp32 inputs go with
input_precision="ieee" (not tf32), so that an fp32 run can match transformers token for token.
Under Triton's interpreter, whose bf16 dot is wrong, every dot runs in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Keys per inner-loop tile, whatever the cache's block size: each key finds its block alone.
TILE_N = 32


@triton.jit
def tile_blocks(tables, key_pos, key_ok, BLOCK_SIZE: tl.constexpr):
    """The cache block of each key at `key_pos`, from the sequence's block table (0 where
    masked)."""
    return tl.load(tables + key_pos // BLOCK_SIZE, mask=key_ok, other=0)


@triton.jit
def next_tile_blocks(blocks, tables, key_pos, num_keys, TILE_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCKS_AHEAD: tl.constexpr):
    """(this tile's blocks, what the loop carries to the next tile). With BLOCKS_AHEAD, the loop
    carries the next tile's blocks, loaded a tile ahead: K and V's addresses then wait on no load
    of their own tile, and Triton's pipeliner keeps two K/V buffers at 3 stages, where
    otherwise the block-table load takes a stage and leaves one (compiled for sm_90 with
    Triton 3.6 and 3.9: docs/performance.md). `blocks` holds the first tile's, loaded before
    the loop; without BLOCKS_AHEAD it is carried unchanged."""
    if BLOCKS_AHEAD:
        ahead = key_pos + TILE_N
        return blocks, tile_blocks(tables, ahead, ahead < num_keys, BLOCK_SIZE)
    return tile_blocks(tables, key_pos, key_pos < num_keys, BLOCK_SIZE), blocks


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, key_pos, key_ok, kv_head, dims, dim_ok,
                 stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                 BLOCK_SIZE: tl.constexpr):
    """The keys at `key_pos`, in cache blocks `blocks` (tile_blocks): K as [head_dim, keys]
    (ready for q @ K) and V as [keys, head_dim]; zeros where a key or a feature is masked."""
    block = blocks.to(tl.int64)
    in_block = key_pos % BLOCK_SIZE
    k = tl.load(k_cache_ptr + block[None, :] * stride_kb + in_block[None, :] * stride_kp
                + kv_head * stride_kh + dims[:, None],
                mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vp
                + kv_head * stride_vh + dims[None, :],
                mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, s_ok, m_i, l_i, acc, scale_log2, FP32_DOT: tl.constexpr):
    """One key tile of an online softmax in base 2: scores q @ k (where `s_ok`, else -inf), the
    running max m_i and sum l_i, and acc rescaled and added p @ v. Returns (m_i, l_i, acc)."""
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = tl.where(s_ok, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with every key masked so far (padding rows) keep a finite shift, not -inf - -inf.
    m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels' dots run in fp32 (ieee): for fp32 inputs, and under the interpreter."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def tile_sizes(group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, HEAD_DIM_PAD): rows of a query tile (tl.dot needs 16 at least), query
    tokens in it, and the head dim padded to a power of two."""
    block_m = max(16, triton.next_power_of_2(group))
    return block_m, block_m // group, max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose numbered query blocks hold `q_block`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
        scale_log2, num_seqs,
        stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
        stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, FP32_DOT: tl.constexpr, BLOCKS_AHEAD: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // GROUP        # the row's token within the chunk
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    query_pos = context + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_start + q_idx).to(tl.int64)   # times a row stride: past 2**31 elements in long steps
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys this block's last token sees: the context and the chunk up to that token.
    num_keys = tl.minimum(seq_len, context + (local_block + 1) * BLOCK_Q)
    tables = block_table_ptr + seq.to(tl.int64) * stride_bt
    first = tl.arange(0, TILE_N)
    carried = tile_blocks(tables, first, first < num_keys, BLOCK_SIZE)
    for start in range(0, num_keys, TILE_N):
        key_pos = start + tl.arange(0, TILE_N)
        key_ok = key_pos < num_keys
        blocks, carried = next_tile_blocks(carried, tables, key_pos, num_keys, TILE_N, BLOCK_SIZE,
                                           BLOCKS_AHEAD)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, blocks, key_pos, key_ok, kv_head, dims,
                            dim_ok, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
                            stride_vh, BLOCK_SIZE)
        causal = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        m_i, l_i, acc = online_softmax_step(q, k, v, causal, m_i, l_i, acc, scale_log2, FP32_DOT)

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def unified_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start: torch.Tensor, scale: float, tile_n: int = TILE_N,
                      num_warps: int | None = None, num_stages: int | None = None,
                      blocks_ahead: bool = True) -> None:
    """Attention for sequences laid out one after another in q.

    out, q: [num_tokens, Hq, D] (any strides); k_cache, v_cache: [num_blocks, block_size,
    Hkv, D], last dim contiguous; block_table: [num_seqs, max_blocks] int32; seq_lens:
    [num_seqs] int32, cached tokens plus the chunk; query_start: [num_seqs + 1] int32, the
    chunks' first rows. `tile_n`, `num_warps` and `num_stages` (Triton's defaults where None)
    are the launch's shape, and `blocks_ahead` the loop's (next_tile_blocks):
    benchmarks/gpu/decode_attention.py times the choices on a GPU.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m, block_q, head_dim_pad = tile_sizes(group, head_dim)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    launch = {name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages))
              if value is not None}
    _unified_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, seq_lens, query_start,
        scale * LOG2E, num_seqs,
        *q.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, FP32_DOT=dot_in_fp32(q.dtype),
        BLOCKS_AHEAD=blocks_ahead, **launch)
