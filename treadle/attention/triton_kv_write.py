"""Writing a step's new K/V into the paged cache through the slot mapping, in Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_kcb, stride_kcp, stride_kch, stride_vcb, stride_vcp, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)   # times a row stride: past 2**31 elements in long steps
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:   # a padding token (vLLM's convention): nothing to write
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + in_block * stride_kcp + heads * stride_kch + dims,
             k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + in_block * stride_vcp + heads * stride_vch + dims,
             v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, Hkv, D] (any strides) into k_cache, v_cache: [num_blocks,
    block_size, Hkv, D] (last dim contiguous) at the flat slots `slot_mapping`
    ([num_tokens]; a negative slot is skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1])
