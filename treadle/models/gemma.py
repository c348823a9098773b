"""Gemma 2 and Gemma 3 (text only): Llama's weights and loading with Gemma's layers.

What differs from Llama, each as transformers computes it:
  - RMSNorm scales by (1 + weight), in fp32 before the cast back;
  - the MLP is GeGLU (gelu, tanh approximation);
  - embeddings are scaled by sqrt(hidden_size), in the model's dtype;
  - norms after attention and around the MLP (pre- and post-feedforward);
  - the attention scale is query_pre_attn_scalar ** -0.5;
  - local (sliding-window) and global layers interleave as `layer_types` says;
  - Gemma 2 soft-caps attention scores and the final logits;
  - Gemma 3 has q/k norms, and its local layers take RoPE of their own base; it soft-caps
    no attention scores, even where its config sets attn_logit_softcapping.
These layers are not Llama's, so the CPU layer stack never serves them (`stackable`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from treadle.attention.backend import AttentionMetadata, PagedAttention
from treadle.distributed.parallel_state import ParallelContext
from treadle.config import layer_window
from treadle.models.llama import MLP, Attention, LlamaForCausalLM
from treadle.models.parallel import MissingLayer, embedding
from treadle.models.rope import RotaryEmbedding

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(nn.Module):
    use_triton = False   # the Triton kernel (models/triton_ops.py), set by use_triton_ops

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from treadle.models import triton_ops
            return triton_ops.rms_norm(x, self.weight, self.eps, unit_offset=True)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class GemmaMLP(MLP):
    """Llama's fused gate/up with gelu (tanh) in place of SiLU; no fused C++ op for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from treadle.models import triton_ops
            return self.down_proj(triton_ops.gelu_tanh_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class GemmaAttention(Attention):
    def __init__(self, config, index: int, qk_norm: bool, ctx: ParallelContext) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        window = layer_window(config, index)
        super().__init__(config, bias, bias, False, ctx, window)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        # Gemma 3 (the one with q/k norms) never soft-caps its scores in transformers, whatever
        # its config's attn_logit_softcapping says (published checkpoints leave it null).
        softcap = None if qk_norm else getattr(config, "attn_logit_softcapping", None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   config.query_pre_attn_scalar ** -0.5, window, softcap)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, index: int, qk_norm: bool, ctx: ParallelContext) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, index, qk_norm, ctx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(hidden, config.intermediate_size, False, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaRotary(nn.Module):
    """RoPE tables for global layers (`rotary`) and local ones (`local`): the same tables
    in Gemma 2, another base (and no scaling) in Gemma 3's local layers."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(_rope_config(config, "full_attention"), head_dim, max_positions)
        local = _rope_config(config, "sliding_attention")
        self.local = (RotaryEmbedding(local, head_dim, max_positions)
                      if local is not config else None)
        self.head_dim, self.dim = self.rotary.head_dim, self.rotary.dim
        self.long_rope_offset = 0   # as RotaryEmbedding's: Gemma has no LongRoPE

    def compute_tables(self) -> None:
        self.rotary.compute_tables()
        if self.local is not None:
            self.local.compute_tables()


def _rope_config(config, layer_type: str):
    """What RotaryEmbedding reads for one kind of layer: Gemma 3's RoPE settings per layer type
    (transformers 5's `rope_parameters`, or the older `rope_local_base_freq` for local layers),
    else the config itself."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return SimpleNamespace(rope_parameters=params[layer_type],
                               max_position_embeddings=config.max_position_embeddings)
    if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return SimpleNamespace(rope_parameters={"rope_type": "default",
                                                "rope_theta": config.rope_local_base_freq},
                               max_position_embeddings=config.max_position_embeddings)
    return config


class GemmaModel(nn.Module):
    """A pipeline stage holds only its layers; the first stage embeds, the last normalises."""

    def __init__(self, config, qk_norm: bool, max_positions: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_range = ctx.layer_range(config.num_hidden_layers)
        self.embed_tokens = (embedding(config.vocab_size, config.hidden_size, ctx)
                             if ctx.is_first_stage else None)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm, ctx) if i in self.layer_range else MissingLayer()
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if ctx.is_last_stage else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = GemmaRotary(config, head_dim, max_positions)


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False
    stackable = False   # models/layer_stack.py knows only Llama's layers

    def __init__(self, config, max_positions: int, ctx: ParallelContext | None = None) -> None:
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation not in _GELU_TANH:
            raise ValueError(f"{type(self).__name__}: hidden_activation {activation!r} is not "
                             f"supported (only {', '.join(_GELU_TANH)})")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention is not supported "
                             "(a decoder attends causally)")
        super().__init__(config, max_positions, ctx)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def build_model(self, config, max_positions: int, ctx: ParallelContext) -> nn.Module:
        return GemmaModel(config, self.qk_norm, max_positions, ctx)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.ctx.is_first_stage:
            h = self.model.embed_tokens(input_ids)
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        else:
            h = hidden
        rotary = self.model.rotary
        tables = rotary.rotary(positions, h.dtype)
        local = rotary.local(positions, h.dtype) if rotary.local is not None else tables
        first = self.model.layer_range.start
        for i in self.model.layer_range:
            layer = self.model.layers[i]
            cos, sin = local if layer.self_attn.attn.sliding_window is not None else tables
            h = layer(h, cos, sin, kv_caches[i - first], meta)
        return self.model.norm(h) if self.ctx.is_last_stage else h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
