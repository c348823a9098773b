"""The attention-backend interface: how a model's attention layers meet the paged KV cache.

A backend turns a step's layout into metadata once per step (`build_metadata`), and that
metadata runs every layer's attention for the step (`AttentionMetadata.attend`). The model's
layers hold only their shape (`PagedAttention`) and never name a backend, so the runner picks
one per device and the models stay the same:
  - `cpu`: the C++ kernels (treadle/kernels), reading K/V through the block table;
  - `torch`: gathers and SDPA in plain torch, on any device;
  - `triton`: Triton kernels on CUDA (on a CPU only under TRITON_INTERPRET=1, for tests).
A new backend is a module with an `AttentionBackend` subclass and a line in `BACKENDS`.

Every backend shares the cache layout [2, num_blocks, block_size, num_kv_heads, head_dim] per
layer and the step's token order: decodes first (one query token each, longest context first),
then prefill chunks. New K/V are written through `slot_mapping` before any attention reads the
cache, so a request may read blocks another request of the same step is filling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from treadle.core.kv_cache_groups import KVCacheGroups
from treadle.device_copy import to_device
from treadle.registry import lookup

# Backends by name, imported only when chosen (treadle/registry.py).
BACKENDS: dict[str, str] = {
    "cpu": "treadle.attention.cpu_backend:CpuKernelBackend",
    "torch": "treadle.attention.torch_backend:TorchBackend",
    "triton": "treadle.attention.triton_backend:TritonBackend",
}


class KVTarget(NamedTuple):
    """Where one layer's new K/V go in this step: its cache's K and V halves ([num_blocks,
    block_size, num_kv_heads, head_dim], features contiguous) and each new token's flat slot
    (negative: a padding token, nothing written)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class PagedAttention:
    """One layer's attention as the model sees it: its shape on this rank, and a call that the
    step's metadata carries out. A query at position p sees keys at p - sliding_window + 1..p
    where the layer has a window (transformers' q_idx - kv_idx < sliding_window); scores are
    soft-capped, logit_softcap * tanh(score / logit_softcap), where it has a cap (Gemma 2).
    `kv_group`: the KV cache group whose block table it reads (core/kv_cache_groups.py; the
    runner sets it, `assign_kv_groups`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    kv_group: int = 0

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: "AttentionMetadata") -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D], after writing k and v to the cache."""
        return meta.attend(self, q, k, v, kv_cache)

    def kv_target(self, kv_cache: torch.Tensor, meta: "AttentionMetadata") -> KVTarget | None:
        """Where a fused op of the model may write this step's K/V itself, in the kernel that
        makes them (RoPE), saving the backend's launch; None where the backend writes them."""
        return meta.kv_target(self, kv_cache)

    def attend_written(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       meta: "AttentionMetadata") -> torch.Tensor:
        """As calling this, where the step's K/V are in the cache already, written to the
        kv_target the metadata gave."""
        return meta.attend_written(self, q, kv_cache)


@dataclass
class AttentionMetadata(ABC):
    """A step's layout, as one backend needs it; built once, read by every layer."""

    slot_mapping: torch.Tensor   # [num_tokens] flat cache slot of each new token
    num_decodes: int             # the first num_decodes tokens are decodes

    @abstractmethod
    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor) -> torch.Tensor:
        """Write k and v to `kv_cache`, then attend: [T, Hq, D] -> [T, Hq * D]."""

    def kv_target(self, layer: PagedAttention, kv_cache: torch.Tensor) -> KVTarget | None:
        """Where the model may write the layer's new K/V itself (PagedAttention.kv_target);
        None, unless a backend takes them so."""
        return None

    def attend_written(self, layer: PagedAttention, q: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        """`attend`, the step's K/V written already to `kv_target`'s answer."""
        raise NotImplementedError(f"{type(self).__name__} writes its own K/V: it gives no kv_target")


@dataclass
class GroupedMetadata(AttentionMetadata):
    """A step's metadata for a model with several KV cache groups: one per group, each over its
    group's block table; a layer attends through its own group's. (The base fields are group
    0's: no layer reads them through this object.)"""

    groups: list[AttentionMetadata]

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor) -> torch.Tensor:
        return self.groups[layer.kv_group].attend(layer, q, k, v, kv_cache)

    def kv_target(self, layer: PagedAttention, kv_cache: torch.Tensor) -> KVTarget | None:
        return self.groups[layer.kv_group].kv_target(layer, kv_cache)

    def attend_written(self, layer: PagedAttention, q: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        return self.groups[layer.kv_group].attend_written(layer, q, kv_cache)


class AttentionBackend(ABC):
    """Builds each step's metadata for one device."""

    name: str

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size

    @classmethod
    @abstractmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None where it can."""

    @abstractmethod
    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       positions: np.ndarray, block_table: np.ndarray) -> AttentionMetadata:
        """Metadata for one step: each request's new tokens and cached tokens (decodes first,
        longest context first), every token's position, and one block-table row per request,
        padded with the null block 0."""

    def build_group_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                             positions: np.ndarray, block_tables: np.ndarray) -> AttentionMetadata:
        """`build_metadata` for each KV cache group's table (block_tables: [group, request,
        block]); one group's is that group's metadata itself."""
        metas = [self.build_metadata(query_lens, context_lens, positions, table)
                 for table in block_tables]
        if len(metas) == 1:
            return metas[0]
        return GroupedMetadata(metas[0].slot_mapping, metas[0].num_decodes, metas)

    def release(self) -> None:
        """Drop scratch memory (the cache is being freed: sleep)."""

    def refuses(self, model: torch.nn.Module) -> str | None:
        """Why this backend cannot serve `model`'s attention layers, or None where it can."""
        return None

    def slot_mapping(self, query_lens: np.ndarray, positions: np.ndarray,
                     block_table: np.ndarray) -> torch.Tensor:
        """The flat cache slot of every new token."""
        return to_device(self.slots(query_lens, positions, block_table), self.device)

    def slots(self, query_lens: np.ndarray, positions: np.ndarray,
              block_table: np.ndarray) -> np.ndarray:
        """The flat cache slot of every new token, on the host (int64)."""
        req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        bs = self.block_size
        slots = block_table[req_of_token, positions // bs] * bs + positions % bs
        return slots.astype(np.int64)


def assign_kv_groups(model: torch.nn.Module, groups: KVCacheGroups) -> None:
    """Tell each of the model's attention layers on this stage its KV cache group, checking
    that a windowed group's window is the layer's own."""
    for i in model.model.layer_range:
        attn = model.model.layers[i].self_attn
        window = groups.window_of_layer(i)
        assert window is None or window == attn.attn.sliding_window, (
            f"layer {i} has window {attn.attn.sliding_window}, its KV cache group {window}")
        attn.attn = replace(attn.attn, kv_group=groups.layer_group[i])


def count_decodes(query_lens: np.ndarray, context_lens: np.ndarray) -> int:
    """How many requests at the front are decodes: one new token after some cached ones."""
    is_decode = (query_lens == 1) & (context_lens > 0)
    return len(query_lens) if is_decode.all() else int(np.argmin(is_decode))


def auto_backend_name(device: torch.device) -> str:
    """The fastest backend that runs on `device`: the C++ kernels on a CPU, Triton on a GPU
    (with its decode CUDA graphs: docs/performance.md, "On a GPU"), else plain torch."""
    best = "triton" if device.type == "cuda" else "cpu"
    return best if backend_class(best).unavailable(device) is None else "torch"


def backend_class(name: str) -> type[AttentionBackend]:
    return lookup(BACKENDS, name, "attention_backend")


def check_attention_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class called `name`; a ValueError if there is none, or if it cannot run on
    `device`, saying why."""
    cls = backend_class(name)
    if (reason := cls.unavailable(device)) is not None:
        raise ValueError(f"attention_backend {name!r} cannot run on {device}: {reason}")
    return cls


def create_attention_backend(name: str | None, device: torch.device,
                             block_size: int) -> AttentionBackend:
    """The backend called `name` (None: the best for `device`), for that device."""
    return check_attention_backend(name or auto_backend_name(device), device)(device, block_size)
