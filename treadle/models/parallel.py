"""The pieces of a model split over ranks: which slice of each weight a rank holds, and where
the partial results meet.

Tensor parallelism (within a stage):
  - column-parallel (q/k/v, gate/up): a rank holds a slice of the output features; attention
    heads are split by rank, KV heads replicated when there are fewer of them than ranks;
  - row-parallel (o_proj, down_proj): a rank holds the matching slice of the input features;
    the partial outputs are summed by an all-reduce, and the bias is added once, after it;
  - vocab-parallel embedding: a rank holds a slice of the vocabulary; tokens outside it look
    up zeros, and the all-reduce fills in every row (a sum of one value and zeros: exact);
  - vocab-parallel head: a rank scores its slice of the vocabulary; an all-gather joins them.
Pipeline parallelism (across stages): a stage builds only its own layers (the others are
empty placeholders, so parameter names still match transformers'); the first stage embeds,
the last one normalises and scores.
With one rank these are the plain layers, op for op.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from treadle.distributed.parallel_state import ParallelContext
from treadle.models import linear
from treadle.models.linear import Linear

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard @ W_shard^T) + b: each rank holds a slice of the input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ctx.all_reduce(linear.linear(x, self.weight, None, self.packed, self.native,
                                                tiles=self.tiles, bf16x3=self.bf16x3))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext) -> None:
        super().__init__(vocab_size // ctx.tp_size, hidden_size)
        self.ctx = ctx
        self.vocab_start = ctx.tp_rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        return self.ctx.all_reduce(out.masked_fill_(outside[:, None], 0))


class MissingLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds."""


def row_linear(in_features: int, out_features: int, bias: bool, ctx: ParallelContext) -> Linear:
    if ctx.tp_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, ctx)


def embedding(vocab_size: int, hidden_size: int, ctx: ParallelContext) -> nn.Embedding:
    if ctx.tp_size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, ctx)


class WeightSharder:
    """Says which transformers-named weights this rank holds (`owns`), and cuts a full tensor
    down to its shard (`shard`)."""

    def __init__(self, config, ctx: ParallelContext, head_dim: int, tied_head_here: bool) -> None:
        self.ctx = ctx
        self.num_layers = config.num_hidden_layers
        self.layers = ctx.layer_range(config.num_hidden_layers)
        self.head_dim = head_dim
        self.num_kv_heads = (getattr(config, "num_key_value_heads", None)
                             or config.num_attention_heads)
        # The last stage scores with its own copy of a tied embedding.
        self.tied_head_here = tied_head_here

    def owns(self, name: str) -> bool:
        ctx = self.ctx
        layer = _LAYER.match(name)
        if layer is not None:   # a layer no stage has is this stage's to refuse
            index = int(layer.group(1))
            return index in self.layers or not 0 <= index < self.num_layers
        if name.startswith("model.embed_tokens."):
            return ctx.is_first_stage or self.tied_head_here
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return ctx.is_last_stage
        return True

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx.tp_size == 1:
            return tensor
        r, t = ctx.tp_rank, ctx.tp_size
        if ".q_proj." in name:
            return _part(name, tensor, 0, r, t)
        if ".k_proj." in name or ".v_proj." in name:
            if self.num_kv_heads >= t:
                return _part(name, tensor, 0, r, t)
            if tensor.shape[0] != self.num_kv_heads * self.head_dim:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{self.num_kv_heads * self.head_dim} rows")
            head = r // (t // self.num_kv_heads)   # replicated: ranks share a KV head
            return tensor.narrow(0, head * self.head_dim, self.head_dim)
        if ".gate_proj." in name or ".up_proj." in name:
            return _part(name, tensor, 0, r, t)
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            return _part(name, tensor, 1, r, t)
        if name.startswith("model.embed_tokens.") or name.startswith("lm_head."):
            return _part(name, tensor, 0, r, t)
        return tensor   # norms and row-parallel biases: every rank holds all of it


def _part(name: str, tensor: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    if tensor.dim() <= dim or tensor.shape[dim] % parts:
        raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)} does not split "
                         f"{parts} ways along dimension {dim}")
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, rank * size, size)
