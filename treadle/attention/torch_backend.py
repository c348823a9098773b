"""Paged attention in plain torch, on any device: the `torch` attention backend.

  - New K/V are written in place through `slot_mapping` with `index_copy_`.
  - Decodes come longest first and are batched in chunks, each a contiguous run of rows of
    similar length. Whole blocks are gathered with `index_select` into a reused buffer,
    padded to the chunk's longest sequence, and masked. Chunks bound the gathered K/V so it
    stays in cache between the copy and SDPA.
  - Each prefill chunk attends to its cached context plus itself, with an explicit
    bottom-right-aligned causal mask (`is_causal=True` aligns top-left, which is wrong
    whenever the query is shorter than the keys).
  - A layer with a sliding window masks the keys before its window, with masks built on first
    use per window and step; a soft-capped layer (Gemma 2) computes its scores in the open, as
    SDPA cannot cap them.
Neither path copies K/V out to every query head (as transformers' repeat_kv does), but for a
soft-capped layer's prefill chunks. On CPU the `cpu` backend (cpu_backend.py) serves instead
wherever the C++ kernels are built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from treadle.attention.backend import AttentionBackend, AttentionMetadata, PagedAttention, count_decodes
from treadle.device_copy import to_device


# Padded key positions per decode chunk: ~3 MiB of fp32 K for 3 KV heads of 64, which stays in
# cache from the gather to SDPA. Measured on 2 cores at 64 decodes of 300-700 tokens: 5x
# faster per layer than one padded batch, and no slower for small batches.
DECODE_CHUNK_TOKENS = 4096


class GatherBuffer:
    """Reused destination for gathered K/V blocks, grown on demand.

    A fresh tensor per layer and step is not free: allocations past glibc's mmap threshold
    (32 MiB at most) come back from the kernel page by page, every time.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def take(self, cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_blocks, *block shape] tensors shaped like blocks of `cache` (K or V)."""
        shape = (num_blocks, *cache.shape[1:])
        numel = math.prod(shape)
        if (self._k is None or self._k.numel() < numel or self._k.dtype != cache.dtype
                or self._k.device != cache.device):
            self._k = torch.empty(numel, dtype=cache.dtype, device=cache.device)
            self._v = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


@dataclass
class DecodeChunk:
    rows: slice                 # which decode tokens (rows of the step) this chunk holds
    block_ids: torch.Tensor     # [n * max_blocks] their block tables, padded with the null block
    mask: torch.Tensor          # [n, 1, 1, max_blocks * block_size] key positions in use
    seq_lens: torch.Tensor      # [n, 1] int64, counting the new token
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """`mask`, less the keys before each query's window: the query sits at seq_len - 1."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.window_masks[window] = self.mask & (key_pos >= self.seq_lens - window)[:, None, None, :]
        return self.window_masks[window]


@dataclass
class PrefillSpan:
    q_start: int
    q_end: int
    context_len: int                 # tokens already cached before this chunk
    block_ids: torch.Tensor | None   # blocks covering context + chunk; None without context
    mask: torch.Tensor | None        # [q_len, context_len + q_len] bool; None without context
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The causal mask (None: plain causal over the chunk alone), less the keys before each
        query's window."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            total = self.context_len + self.q_end - self.q_start
            key_pos = torch.arange(total, device=device)
            query_pos = torch.arange(self.context_len, total, device=device)[:, None]
            self.window_masks[window] = (key_pos <= query_pos) & (key_pos > query_pos - window)
        return self.window_masks[window]


@dataclass
class TorchMetadata(AttentionMetadata):
    decode_chunks: list[DecodeChunk]
    prefills: list[PrefillSpan]
    gather_buffer: GatherBuffer

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size = k_cache.shape[:2]
        hkv, d = layer.num_kv_heads, layer.head_dim
        k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, self.slot_mapping, k)
        v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, self.slot_mapping, v)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # q may be a strided view
        for chunk in self.decode_chunks:
            n = chunk.mask.shape[0]
            kd, vd = self._gather(k_cache, v_cache, chunk.block_ids)
            # The query heads sharing a KV head become that head's queries: one query token
            # sees the same keys from every head of a group. Several times faster than
            # enable_gqa on CPU (6x in bf16).
            o = _attention(
                layer, q[chunk.rows].view(n, hkv, layer.group_size, d),
                kd.view(n, -1, hkv, d).transpose(1, 2), vd.view(n, -1, hkv, d).transpose(1, 2),
                chunk.mask_for(layer.sliding_window))
            out[chunk.rows] = o.reshape(n, layer.num_heads, d)
        for span in self.prefills:
            qp = q[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0)
            mask = span.mask_for(layer.sliding_window, q.device)
            if span.context_len == 0:
                kp, vp = k[span.q_start:span.q_end], v[span.q_start:span.q_end]
            else:
                total = span.context_len + span.q_end - span.q_start
                kp, vp = self._gather(k_cache, v_cache, span.block_ids)
                kp, vp = kp.view(-1, hkv, d)[:total], vp.view(-1, hkv, d)[:total]
            o = _attention(layer, qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                           mask)
            out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], layer.num_heads * d)

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_out, v_out = self.gather_buffer.take(k_cache, block_ids.shape[0])
        return (torch.index_select(k_cache, 0, block_ids, out=k_out),
                torch.index_select(v_cache, 0, block_ids, out=v_out))


def _attention(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """q [..., Hq, Tq, D] against k/v [..., Hkv, Tk, D] (Hq a multiple of Hkv); mask [Tq, Tk]
    bool or broadcastable to the scores, None: causal over Tq == Tk."""
    if layer.logit_softcap is None:
        # Decodes come with KV heads and queries paired already: no enable_gqa (slower on CPU).
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=layer.scale, enable_gqa=q.shape[-3] != k.shape[-3])
    # As transformers' eager attention for Gemma 2: scaled scores, capped, masked, fp32 softmax.
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device, block_size: int) -> None:
        super().__init__(device, block_size)
        self.gather_buffer = GatherBuffer()

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        return None

    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       positions: np.ndarray, block_table: np.ndarray) -> TorchMetadata:
        num_decodes = count_decodes(query_lens, context_lens)
        n = num_decodes
        return TorchMetadata(
            self.slot_mapping(query_lens, positions, block_table), num_decodes,
            _decode_chunks(context_lens[:n] + 1, block_table[:n], self.block_size, self.device),
            _prefill_spans(n, query_lens[n:], context_lens[n:], block_table[n:], self.block_size,
                           self.device),
            self.gather_buffer)

    def release(self) -> None:
        self.gather_buffer = GatherBuffer()


def _prefill_spans(start: int, query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray,
                   block_size: int, device: torch.device) -> list[PrefillSpan]:
    """Prefill chunks, the first at row `start` of the step."""
    spans = []
    for q_len, ctx, table in zip(query_lens.tolist(), context_lens.tolist(), block_table):
        span = PrefillSpan(start, start + q_len, ctx, None, None)
        if ctx > 0:
            total = ctx + q_len
            span.block_ids = to_device(table[:-(-total // block_size)].astype(np.int64), device)
            key_pos = torch.arange(total, device=device)
            query_pos = torch.arange(ctx, total, device=device)
            span.mask = key_pos[None, :] <= query_pos[:, None]
        spans.append(span)
        start += q_len
    return spans


def _decode_chunks(seq_lens: np.ndarray, block_table: np.ndarray, block_size: int,
                   device: torch.device) -> list[DecodeChunk]:
    """Decodes (longest first) cut into runs of at most DECODE_CHUNK_TOKENS padded key
    positions; a longer sequence gets a chunk of its own."""
    assert (np.diff(seq_lens) <= 0).all(), "decodes must come longest first"
    chunks = []
    start = 0
    while start < len(seq_lens):
        max_blocks = -(-int(seq_lens[start]) // block_size)
        n = max(1, min(len(seq_lens) - start, DECODE_CHUNK_TOKENS // (max_blocks * block_size)))
        rows = slice(start, start + n)
        start += n
        key_pos = torch.arange(max_blocks * block_size, device=device)
        lens = to_device(seq_lens[rows].astype(np.int64), device)
        chunks.append(DecodeChunk(
            rows=rows,
            block_ids=to_device(block_table[rows, :max_blocks].astype(np.int64).ravel(), device),
            mask=(key_pos[None, :] < lens[:, None])[:, None, None, :],
            seq_lens=lens[:, None]))
    return chunks
