"""Rotary position embeddings as transformers computes them: the inverse frequencies of the
default, linear, llama3 and longrope schemes, fp32 cos/sin tables by position, rotate-half, and
a rotary part of each head smaller than the head (`partial_rotary_factor`, Phi-4-mini).

LongRoPE (Phi-3) scales the frequencies by one factor list (short) while a sequence fits the
model's original context, and by another (long) once it is longer, and cos/sin by one attention
factor throughout. transformers recomputes a sequence's whole cache with the long factors when
it first grows past that context, and so does the engine: a request is short or long for all
its tokens (`Request.long_rope`; the scheduler restarts it when it crosses). Where max_model_len
goes past the original context, the tables hold the long rows after the short ones, and a long
request's tokens read them at `position + long_rope_offset`.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config) -> dict:
    """RoPE settings from either transformers 5's `rope_parameters` or the older top-level fields."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rotary_dim(config, head_dim: int) -> int:
    """How many of a head's features RoPE rotates (the first ones)."""
    factor = rope_parameters(config).get("partial_rotary_factor",
                                         getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def rope_inv_freq(config, dim: int, long: bool = False) -> torch.Tensor:
    """The inverse frequencies over `dim` rotary features (LongRoPE's long ones if `long`)."""
    params = rope_parameters(config)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = params["rope_type"]
    if rope_type == "longrope":
        factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * base ** exponents)
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "default":
        # a GGUF's rope_freqs tensor (models/gguf_config.py): llama.cpp's per-pair divisors
        factors = getattr(config, "rope_freq_factors", None)
        return inv_freq if factors is None else inv_freq / torch.tensor(factors, dtype=torch.float32)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r} "
                     "(supported: default, linear, llama3, longrope)")


def longrope_original_len(config) -> int | None:
    """The original context of a LongRoPE model, past which it takes its long factors; None
    for every other scheme."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    return int(params.get("original_max_position_embeddings")
               or getattr(config, "original_max_position_embeddings", None)
               or config.max_position_embeddings)


def long_rope_after(config, max_model_len: int) -> int | None:
    """The length past which a request's tokens all take LongRoPE's long factors, where
    max_model_len reaches past it; None where no request can (every other scheme, or a
    max_model_len within the original context)."""
    original = longrope_original_len(config)
    return original if original is not None and max_model_len > original else None


def _attention_factor(config) -> float:
    """longrope's scale of cos and sin (1 for every other scheme)."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = longrope_original_len(config)
    factor = params.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """fp32 cos/sin tables by position. With LongRoPE past the original context, rows
    [max_positions, 2 * max_positions) hold the long factors' tables (`long_rope_offset`)."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config, self.head_dim = config, head_dim
        self.dim = rotary_dim(config, head_dim)
        self.max_positions = max_positions
        has_long = long_rope_after(config, max_positions) is not None
        self.long_rope_offset = max_positions if has_long else 0
        rows = 2 * max_positions if has_long else max_positions
        self.register_buffer("cos", torch.empty(rows, self.dim), persistent=False)
        self.register_buffer("sin", torch.empty(rows, self.dim), persistent=False)
        self.compute_tables()

    def compute_tables(self) -> None:
        """Fill the fp32 cos/sin tables; again after the model was built on the meta device."""
        device = self.cos.device
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        variants = (False, True) if self.long_rope_offset else (False,)
        emb = torch.cat([self._angles(positions, long) for long in variants])
        scale = _attention_factor(self.config)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale

    def _angles(self, positions: torch.Tensor, long: bool) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.config, self.dim, long).to(positions.device)
        return torch.cat((positions[:, None] * inv_freq[None, :],) * 2, dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D]: broadcast over heads.
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of each head; the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        dim = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
