"""Paged attention in torch (CPU, and a fallback on GPU), with one C++ kernel on CPU.

KV cache per layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
A step's tokens are laid out decodes first (one query token each), then prefill chunks.
  - New K/V are written in place through `slot_mapping`, before any attention reads the cache,
    so a request may read blocks another request of the same step is filling.
  - On CPU, decodes and prefill chunks go to C++ kernels (treadle/kernels), which read K/V
    through the block table: one call per layer for all decodes, one for all prefill chunks.
  - Otherwise decodes come longest first and are batched in chunks, each a contiguous run of rows of
    similar length. Whole blocks are gathered with `index_select` into a reused buffer,
    padded to the chunk's longest sequence, and masked. Chunks bound the gathered K/V so it
    stays in cache between the copy and SDPA.
  - Each prefill chunk attends to its cached context plus itself, with an explicit
    bottom-right-aligned causal mask (`is_causal=True` aligns top-left, which is wrong
    whenever the query is shorter than the keys).
Neither path copies K/V out to every query head (as transformers' repeat_kv does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


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


@dataclass
class NativeDecode:
    block_table: torch.Tensor   # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor      # [num_decodes] int32, counting the new token


@dataclass
class NativePrefill:
    block_table: torch.Tensor   # [num_spans, max_blocks] int32
    query_start: torch.Tensor   # [num_spans + 1] int32, rows counted from the first prefill row
    context_lens: torch.Tensor  # [num_spans] int32, tokens cached before each chunk


@dataclass
class PrefillSpan:
    q_start: int
    q_end: int
    context_len: int                 # tokens already cached before this chunk
    block_ids: torch.Tensor | None   # blocks covering context + chunk; None without context
    mask: torch.Tensor | None        # [q_len, context_len + q_len] bool; None without context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [num_tokens] flat cache slot of each new token
    num_decodes: int                    # the first num_decodes tokens are decodes
    native_decode: NativeDecode | None  # decodes for the C++ kernel, or else...
    decode_chunks: list[DecodeChunk]    # ...decodes for the torch path
    native_prefill: NativePrefill | None  # prefill chunks for the C++ kernel, or else...
    prefills: list[PrefillSpan]           # ...prefill chunks for the torch path
    gather_buffer: GatherBuffer
    native_kernels: bool = False          # the C++ ops (treadle/kernels) write the new K/V


def build_metadata(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
    gather_buffer: GatherBuffer,
    native_kernels: bool = False,
) -> AttentionMetadata:
    """Metadata for one step.

    Requests come decodes first (query_len 1 with some context), longest context first.
    `positions` holds every token's position, `block_table` one row per request, padded with
    the null block 0. `native_kernels` sends decodes and prefill chunks to the C++ kernels.
    """
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    slot_mapping = torch.from_numpy(slots.astype(np.int64)).to(device)

    is_decode = (query_lens == 1) & (context_lens > 0)
    num_decodes = len(query_lens) if is_decode.all() else int(np.argmin(is_decode))
    seq_lens = context_lens[:num_decodes] + 1
    native_decode, decode_chunks = None, []
    if native_kernels and num_decodes:
        max_blocks = -(-int(seq_lens.max()) // block_size)
        native_decode = NativeDecode(
            torch.from_numpy(np.ascontiguousarray(block_table[:num_decodes, :max_blocks], dtype=np.int32)),
            torch.from_numpy(seq_lens.astype(np.int32)))
    else:
        decode_chunks = _decode_chunks(seq_lens, block_table, block_size, device)

    q_lens, ctx, table = query_lens[num_decodes:], context_lens[num_decodes:], block_table[num_decodes:]
    native_prefill, prefills = None, []
    if native_kernels and len(q_lens):
        max_blocks = -(-int((ctx + q_lens).max()) // block_size)
        native_prefill = NativePrefill(
            torch.from_numpy(np.ascontiguousarray(table[:, :max_blocks], dtype=np.int32)),
            torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
            torch.from_numpy(ctx.astype(np.int32)))
    else:
        prefills = _prefill_spans(num_decodes, q_lens, ctx, table, block_size, device)
    return AttentionMetadata(slot_mapping, num_decodes, native_decode, decode_chunks, native_prefill,
                             prefills, gather_buffer, native_kernels)


def _prefill_spans(start: int, query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray,
                   block_size: int, device: torch.device) -> list[PrefillSpan]:
    """Prefill chunks for the torch path, the first at row `start` of the step."""
    spans = []
    for q_len, ctx, table in zip(query_lens.tolist(), context_lens.tolist(), block_table):
        span = PrefillSpan(start, start + q_len, ctx, None, None)
        if ctx > 0:
            total = ctx + q_len
            span.block_ids = torch.from_numpy(table[:-(-total // block_size)].astype(np.int64)).to(device)
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
        lens = torch.from_numpy(seq_lens[rows].astype(np.int64)).to(device)
        chunks.append(DecodeChunk(
            rows=rows,
            block_ids=torch.from_numpy(block_table[rows, :max_blocks].astype(np.int64).ravel()).to(device),
            mask=(key_pos[None, :] < lens[:, None])[:, None, None, :]))
    return chunks


class TorchAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.native_kernels:
            torch.ops.treadle.write_kv_(kv_cache, k, v, meta.slot_mapping)
        else:
            num_blocks, block_size = k_cache.shape[:2]
            flat_k = k_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
            flat_v = v_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # q may be a strided view
        if meta.native_decode is not None:
            n = meta.num_decodes
            torch.ops.treadle.paged_decode_attention(
                out[:n], q[:n], k_cache, v_cache, meta.native_decode.block_table,
                meta.native_decode.seq_lens, self.scale)
        if meta.native_prefill is not None:
            # Every prefill chunk goes to the kernel: it beat the torch path in every shape
            # measured (2 cores, SmolLM2-135M's 9 heads on 3 KV heads of 64, one layer, median ms
            # fp32/bf16): a 512-token prompt 5.0/4.5 -> 2.8/2.6; 256 tokens after 1024 cached
            # 6.3/7.0 -> 6.0/5.3; 16 spans of 4 after 300-700 (draft verification) 3.9/3.3 ->
            # 1.1/0.9; 4 prompts of 128 1.6/1.7 -> 1.0/1.0.
            n, p = meta.num_decodes, meta.native_prefill
            torch.ops.treadle.paged_prefill_attention(
                out[n:], q[n:], k_cache, v_cache, p.block_table, p.query_start, p.context_lens, self.scale)
        for chunk in meta.decode_chunks:
            n = chunk.mask.shape[0]
            kd, vd = self._gather(k_cache, v_cache, chunk.block_ids, meta.gather_buffer)
            # The query heads sharing a KV head become that head's queries: one query token
            # sees the same keys from every head of a group. Several times faster than
            # enable_gqa on CPU (6x in bf16).
            o = F.scaled_dot_product_attention(
                q[chunk.rows].view(n, self.num_kv_heads, self.group_size, self.head_dim),
                kd.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2),
                vd.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2),
                attn_mask=chunk.mask, scale=self.scale)
            out[chunk.rows] = o.reshape(n, self.num_heads, self.head_dim)
        for span in meta.prefills:
            qp = q[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0)
            if span.context_len == 0:
                kp, vp = k[span.q_start:span.q_end], v[span.q_start:span.q_end]
                causal, mask = True, None
            else:
                total = span.mask.shape[1]
                kp, vp = self._gather(k_cache, v_cache, span.block_ids, meta.gather_buffer)
                kp = kp.view(-1, self.num_kv_heads, self.head_dim)[:total]
                vp = vp.view(-1, self.num_kv_heads, self.head_dim)[:total]
                causal, mask = False, span.mask
            o = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    @staticmethod
    def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                buffer: GatherBuffer) -> tuple[torch.Tensor, torch.Tensor]:
        k_out, v_out = buffer.take(k_cache, block_ids.shape[0])
        return (torch.index_select(k_cache, 0, block_ids, out=k_out),
                torch.index_select(v_cache, 0, block_ids, out=v_out))
