"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, Llama-family layers whose feed-forward
block routes each token to its top-k experts.

Each expert is a SwiGLU MLP of its own `Linear`s, so the CPU machinery that packs, quantizes and
tiles the dense weights serves the experts unchanged, and a step reads only the weights of the
experts its tokens chose. Experts run grouped: each chosen expert once, over all the tokens
that chose it, in expert order, with the results added in place as transformers does (the same
order of additions in fp32). Under tensor parallelism every rank holds a slice of every
expert's intermediate features; the block's partial sums meet in one all-reduce.

Checkpoints name experts one by one (`mlp.experts.3.gate_proj.weight`, or Mixtral's
`block_sparse_moe.experts.3.w1.weight`); transformers 5 holds them stacked
(`mlp.experts.gate_up_proj` of [experts, 2 x intermediate, hidden]), which is what a trainer's
`named_parameters()` sends. Every form loads: `expert_weights` turns each into the first.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from treadle.distributed.parallel_state import ParallelContext
from treadle.models.llama import LlamaForCausalLM, MLP, dense_mlp


class Router(nn.Module):
    """The gate: one logit per expert for each token (transformers' `mlp.gate.weight`)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool, weights_in_fp32: bool, ctx: ParallelContext) -> None:
        """`normalize`: top-k probabilities rescaled to sum to one. `weights_in_fp32`: they
        scale the experts' outputs in fp32 (Mixtral) rather than in the model's dtype (Qwen3)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.normalize, self.weights_in_fp32 = normalize, weights_in_fp32
        self.ctx = ctx
        self.gate = Router(num_experts, hidden_size)
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size, False, ctx, reduce=False)
                                     for _ in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for each token."""
        logits = nn.functional.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_in_fp32 else weights.to(logits.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # [k, T]: where() then lists an expert's tokens by rank of choice, then token, as
        # transformers' expert mask does.
        chosen = experts.t()
        for e in torch.unique(experts).tolist():   # one host sync per layer: which experts run
            rank, token = torch.where(chosen == e)
            y = self.experts[e](x[token]) * weights[token, rank, None]
            out.index_add_(0, token, y.to(out.dtype))
        return self.ctx.all_reduce(out)


# Per-expert names, as checkpoints write them, for every form a weight may arrive in.
_MIXTRAL_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def expert_weights(weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The same weights, every expert's under its own `mlp.experts.N.{gate,up,down}_proj` name
    and the router as `mlp.gate.weight`."""
    for name, tensor in weights:
        mixtral = _MIXTRAL_EXPERT.match(name)
        stacked = _STACKED.match(name)
        if mixtral is not None:
            prefix, e, part = mixtral.groups()
            yield f"{prefix}.mlp.experts.{e}.{_MIXTRAL_PARTS[part]}.weight", tensor
        elif ".block_sparse_moe.gate." in name:
            yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
        elif stacked is not None:
            prefix, part = stacked.groups()
            for e, expert in enumerate(tensor.unbind(0)):
                if part == "down_proj":
                    yield f"{prefix}.mlp.experts.{e}.down_proj.weight", expert
                else:   # gate, then up, stacked along the rows
                    gate, up = expert.chunk(2, dim=0)
                    yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", gate
                    yield f"{prefix}.mlp.experts.{e}.up_proj.weight", up
        else:
            yield name, tensor


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose feed-forward blocks (some or all) are mixtures of experts."""

    capturable = False   # which experts run is read back to the host, once per layer

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        return expert_weights(weights)


def _qwen3_moe_mlp(config, index: int, ctx: ParallelContext) -> nn.Module:
    sparse = (index not in (getattr(config, "mlp_only_layers", None) or [])
              and config.num_experts > 0 and (index + 1) % config.decoder_sparse_step == 0)
    if not sparse:
        return dense_mlp(config, index, ctx)
    return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                          config.num_experts_per_tok, bool(config.norm_topk_prob), False, ctx)


def _mixtral_mlp(config, index: int, ctx: ParallelContext) -> nn.Module:
    return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                          config.num_experts_per_tok, True, True, ctx)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3 attention (RMSNorm on q and k); experts on every `decoder_sparse_step`-th layer
    not in `mlp_only_layers`, dense MLPs elsewhere."""

    qk_norm = True
    make_mlp = staticmethod(_qwen3_moe_mlp)


class MixtralForCausalLM(MoeForCausalLM):
    """Mistral attention; experts on every layer, top-k weights always normalised."""

    make_mlp = staticmethod(_mixtral_mlp)
