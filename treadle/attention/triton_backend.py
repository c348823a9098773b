"""Paged attention in Triton: the `triton` attention backend, for CUDA devices.

  - New K/V go into the cache through `slot_mapping` (triton_kv_write.py), or the model's
    RoPE kernel writes them there as it makes them (`kv_target`; models/triton_ops.py).
  - One launch of the unified kernel (triton_unified.py) serves the whole step: decodes,
    prefill chunks over a cached prefix, and 1 + k draft verification.
  - A few long decodes take the split-KV path instead (triton_decode.py), and the unified
    kernel the rest of the step.
The metadata is built from the step's host arrays with one non-blocking copy to the device
(slot mapping included, as int32); nothing is read back, and the kernels' grids come from
counts the host already has.

On a CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, set before treadle
starts): slow, but it holds the kernels to the other backends and to transformers in CI.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch

from treadle.attention.backend import (AttentionBackend, AttentionMetadata, KVTarget, PagedAttention,
                                      count_decodes)
from treadle.device_copy import host_tensor


def _check_layer(layer: PagedAttention) -> None:
    if layer.sliding_window is not None or layer.logit_softcap is not None:
        raise NotImplementedError(
            "attention_backend 'triton' has no sliding window or logit soft-cap yet: use "
            "attention_backend 'torch' for this model")


@dataclass
class TritonMetadata(AttentionMetadata):
    block_table: torch.Tensor    # [num_reqs, max_blocks] int32, up to the longest sequence's
    seq_lens: torch.Tensor       # [num_reqs] int32: cached tokens plus this step's
    query_start: torch.Tensor    # [num_reqs + 1] int32: each request's first row
    num_kv_splits: int           # > 1: the decodes take the split-KV path
    # With splits: query_start of the requests after the decodes, counted from their first row.
    rest_query_start: torch.Tensor | None
    split_min_tokens: int = 1    # a decode takes one range per this many keys (triton_decode.py)

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor) -> torch.Tensor:
        # Imported on first use: treadle imports without triton, and a kernel is interpreted or
        # compiled as its module is imported (TRITON_INTERPRET).
        from treadle.attention.triton_kv_write import write_kv

        _check_layer(layer)
        write_kv(k, v, kv_cache[0], kv_cache[1], self.slot_mapping)
        return self._attend(layer, q, kv_cache)

    def kv_target(self, layer: PagedAttention, kv_cache: torch.Tensor) -> KVTarget:
        return KVTarget(kv_cache[0], kv_cache[1], self.slot_mapping)

    def attend_written(self, layer: PagedAttention, q: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        _check_layer(layer)
        return self._attend(layer, q, kv_cache)

    def _attend(self, layer: PagedAttention, q: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention over the cache, the step's K/V in it, the layer checked."""
        from treadle.attention.triton_decode import split_kv_decode
        from treadle.attention.triton_unified import unified_attention

        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = self.num_decodes
        if self.num_kv_splits > 1:
            split_kv_decode(out[:n], q[:n], k_cache, v_cache, self.block_table[:n],
                            self.seq_lens[:n], layer.scale, self.num_kv_splits,
                            self.split_min_tokens)
            if n < self.block_table.shape[0]:
                unified_attention(out[n:], q[n:], k_cache, v_cache, self.block_table[n:],
                                  self.seq_lens[n:], self.rest_query_start, layer.scale)
        else:
            unified_attention(out, q, k_cache, v_cache, self.block_table, self.seq_lens,
                              self.query_start, layer.scale)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)


class TritonBackend(AttentionBackend):
    name = "triton"
    # When decodes take the split-KV path, from benchmarks/gpu/decode_attention.py on an H200
    # (132 SMs; 8 KV heads, head dim 128, bf16; docs/performance.md, "On a GPU"): the fastest
    # split count kept about 64 (decode, range) pairs in flight, so 16 ranges at 1-4 decodes, 4
    # at 16, 2 at 32 (1.1-10x the unified kernel), and at 32 keys a range it still paid.
    split_max_decodes = 32   # past this many decodes, none split (measured up to 32)
    split_target_ranges = 64   # (decode, range) pairs a step aims for
    split_min_tokens = 32   # keys a range holds at least
    max_kv_splits = 16

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available here"
            if torch.cuda.get_device_capability(device)[0] < 8:   # bf16 tl.dot needs sm_80
                return "its kernels need compute capability 8.0 (Ampere) or newer"
            return None
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") == "1":
                return None
            return ("on a CPU its kernels run only through Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before starting (slow: for tests), or use "
                    "attention_backend 'cpu' or 'torch'")
        return "its kernels are for CUDA devices"

    def refuses(self, model: torch.nn.Module) -> str | None:
        layers = (model.model.layers[i].self_attn.attn for i in model.model.layer_range)
        if any(a.sliding_window is not None or a.logit_softcap is not None for a in layers):
            return "it has no sliding window or logit soft-cap yet"
        return None

    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       positions: np.ndarray, block_table: np.ndarray) -> TritonMetadata:
        n = count_decodes(query_lens, context_lens)
        num_reqs = len(query_lens)
        seq_lens = context_lens + query_lens
        max_blocks = max(1, -(-int(seq_lens.max(initial=0)) // self.block_size))
        query_start = np.concatenate([[0], np.cumsum(query_lens)])
        splits = self.kv_splits(seq_lens[:n])
        rest = query_start[n:] - query_start[n] if splits > 1 else np.zeros(0, np.int64)
        slots = self.slots(query_lens, positions, block_table)
        # One copy to the device for every array, then views of it. Slots fit in int32: a
        # cache of 2**31 token slots would hold terabytes.
        table = block_table[:, :max_blocks].ravel()
        packed = self._to_device(
            np.concatenate([slots, seq_lens, query_start, rest, table]).astype(np.int32))
        slots_t, seq_lens_t, query_start_t, rest_t, table_t = packed.split(
            [len(slots), num_reqs, num_reqs + 1, len(rest), num_reqs * max_blocks])
        return TritonMetadata(slots_t, n, table_t.view(num_reqs, max_blocks), seq_lens_t,
                              query_start_t, splits, rest_t if splits > 1 else None,
                              self.split_min_tokens)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device, without blocking on CUDA."""
        return host_tensor(array, self.device).to(self.device, non_blocking=True)

    def kv_splits(self, decode_seq_lens: np.ndarray) -> int:
        """How many key ranges each decode is cut into: 1 for none, or for many decodes."""
        longest = int(decode_seq_lens.max(initial=0))
        return min(self.batch_splits(len(decode_seq_lens)), max(1, longest // self.split_min_tokens))

    def batch_splits(self, num_decodes: int) -> int:
        """The most ranges a step of this many decodes cuts each into (1: none split); each
        sequence takes fewer where it is short (triton_decode.py). The same for every count up
        to the next power of two, so that a CUDA graph captured at a padded size (every power
        of two up to 8, then multiples of 8) sums each decode's keys in the order an eager
        step of its unpadded count would."""
        if not 0 < num_decodes <= self.split_max_decodes:
            return 1
        bucket = 1 << (num_decodes - 1).bit_length()
        return max(1, min(self.max_kv_splits, self.split_target_ranges // bucket))
