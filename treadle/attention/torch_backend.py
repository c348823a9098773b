"""Paged attention in plain torch (CPU, and a fallback on GPU).

KV cache per layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
A step's tokens are laid out decodes first (one query token each), then prefill chunks.
  - New K/V are written in place through `slot_mapping`, before any attention reads the cache,
    so a request may read blocks another request of the same step is filling.
  - Decodes are batched: whole blocks are gathered with `index_select` (contiguous copies),
    padded to the longest sequence, and masked.
  - Each prefill chunk attends to its cached context plus itself, with an explicit
    bottom-right-aligned causal mask (`is_causal=True` aligns top-left, which is wrong
    whenever the query is shorter than the keys).
SDPA's `enable_gqa` avoids copying K/V out to every query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int
    q_end: int
    context_len: int                 # tokens already cached before this chunk
    block_ids: torch.Tensor | None   # blocks covering context + chunk; None without context
    mask: torch.Tensor | None        # [q_len, context_len + q_len] bool; None without context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [num_tokens] flat cache slot of each new token
    num_decodes: int                           # the first num_decodes tokens are decodes
    decode_block_table: torch.Tensor | None    # [num_decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None           # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSpan]


def build_metadata(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for one step.

    Requests come decodes first (query_len 1 with some context). `positions` holds every
    token's position, `block_table` one row per request, padded with the null block 0.
    """
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    slot_mapping = torch.from_numpy(slots.astype(np.int64)).to(device)

    is_decode = (query_lens == 1) & (context_lens > 0)
    num_decodes = len(query_lens) if is_decode.all() else int(np.argmin(is_decode))
    decode_table = decode_mask = None
    if num_decodes:
        seq_lens = context_lens[:num_decodes] + 1
        max_blocks = -(-int(seq_lens.max()) // block_size)
        decode_table = torch.from_numpy(block_table[:num_decodes, :max_blocks].astype(np.int64)).to(device)
        key_pos = torch.arange(max_blocks * block_size, device=device)
        lens = torch.from_numpy(seq_lens.astype(np.int64)).to(device)
        decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]

    prefills = []
    start = num_decodes
    for i in range(num_decodes, len(query_lens)):
        q_len, ctx = int(query_lens[i]), int(context_lens[i])
        span = PrefillSpan(start, start + q_len, ctx, None, None)
        if ctx > 0:
            total = ctx + q_len
            span.block_ids = torch.from_numpy(
                block_table[i, :-(-total // block_size)].astype(np.int64)).to(device)
            key_pos = torch.arange(total, device=device)
            query_pos = torch.arange(ctx, total, device=device)
            span.mask = key_pos[None, :] <= query_pos[:, None]
        prefills.append(span)
        start += q_len
    return AttentionMetadata(slot_mapping, num_decodes, decode_table, decode_mask, prefills)


class TorchAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size = k_cache.shape[:2]
        flat_k = k_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            table = meta.decode_block_table
            kd = self._gather(k_cache, table.flatten()).view(nd, -1, self.num_kv_heads, self.head_dim)
            vd = self._gather(v_cache, table.flatten()).view(nd, -1, self.num_kv_heads, self.head_dim)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2),
                attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for span in meta.prefills:
            qp = q[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0)
            if span.context_len == 0:
                kp, vp = k[span.q_start:span.q_end], v[span.q_start:span.q_end]
                causal, mask = True, None
            else:
                total = span.mask.shape[1]
                kp = self._gather(k_cache, span.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:total]
                vp = self._gather(v_cache, span.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:total]
                causal, mask = False, span.mask
            o = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return cache.index_select(0, block_ids)
