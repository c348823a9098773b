"""Paged attention in the C++ kernels (treadle/kernels): the `cpu` attention backend.

The kernels read K/V straight out of the block table: one call per layer for all of a step's
decodes, one for all of its prefill chunks, where the torch backend gathers, masks and calls
SDPA per chunk. A step on this backend is also one the CPU layer stack may run whole
(models/layer_stack.py), which reads the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.attention.backend import AttentionBackend, AttentionMetadata, PagedAttention, count_decodes
from treadle.kernels.cpu import cpu_kernels_available


@dataclass
class KernelDecodes:
    block_table: torch.Tensor   # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor      # [num_decodes] int32, counting the new token


@dataclass
class KernelPrefills:
    block_table: torch.Tensor   # [num_spans, max_blocks] int32
    query_start: torch.Tensor   # [num_spans + 1] int32, rows counted from the first prefill row
    context_lens: torch.Tensor  # [num_spans] int32, tokens cached before each chunk


@dataclass
class CpuKernelMetadata(AttentionMetadata):
    decodes: KernelDecodes | None     # None: no decodes this step
    prefills: KernelPrefills | None   # None: no prefill chunks this step

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor) -> torch.Tensor:
        torch.ops.treadle.write_kv_(kv_cache, k, v, self.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # q may be a strided view
        n = self.num_decodes
        window, softcap = layer.sliding_window or 0, layer.logit_softcap or 0.0   # 0: none
        if (d := self.decodes) is not None:
            torch.ops.treadle.paged_decode_attention(
                out[:n], q[:n], k_cache, v_cache, d.block_table, d.seq_lens, layer.scale, window, softcap)
        if (p := self.prefills) is not None:
            # Every prefill chunk goes to the kernel: it beat the torch path in every shape
            # measured (2 cores, SmolLM2-135M's 9 heads on 3 KV heads of 64, one layer, median ms
            # fp32/bf16): a 512-token prompt 5.0/4.5 -> 2.8/2.6; 256 tokens after 1024 cached
            # 6.3/7.0 -> 6.0/5.3; 16 spans of 4 after 300-700 (draft verification) 3.9/3.3 ->
            # 1.1/0.9; 4 prompts of 128 1.6/1.7 -> 1.0/1.0.
            torch.ops.treadle.paged_prefill_attention(
                out[n:], q[n:], k_cache, v_cache, p.block_table, p.query_start, p.context_lens,
                layer.scale, window, softcap)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)


class CpuKernelBackend(AttentionBackend):
    name = "cpu"

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "its kernels are for CPUs"
        if not cpu_kernels_available(device):   # builds them on first use
            return ("the C++ kernels are not built here (TREADLE_CPU_KERNELS=0, or no compiler; "
                    "python -m treadle.kernels says why)")
        return None

    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       positions: np.ndarray, block_table: np.ndarray) -> CpuKernelMetadata:
        n = count_decodes(query_lens, context_lens)
        decodes = prefills = None
        if n:
            seq_lens = context_lens[:n] + 1
            decodes = KernelDecodes(self._table(block_table[:n], int(seq_lens.max())),
                                    torch.from_numpy(seq_lens.astype(np.int32)))
        q_lens, ctx = query_lens[n:], context_lens[n:]
        if len(q_lens):
            prefills = KernelPrefills(
                self._table(block_table[n:], int((ctx + q_lens).max())),
                torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
                torch.from_numpy(ctx.astype(np.int32)))
        return CpuKernelMetadata(self.slot_mapping(query_lens, positions, block_table), n,
                                 decodes, prefills)

    def _table(self, block_table: np.ndarray, max_tokens: int) -> torch.Tensor:
        """The rows' blocks up to the longest sequence's last, as the kernels take them."""
        max_blocks = -(-max_tokens // self.block_size)
        return torch.from_numpy(np.ascontiguousarray(block_table[:, :max_blocks], dtype=np.int32))
