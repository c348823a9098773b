"""Rotary position embeddings as transformers computes them: the inverse frequencies of the
default, linear and llama3 schemes, fp32 cos/sin tables by position, and rotate-half."""

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


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    params = rope_parameters(config)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
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
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config, self.head_dim = config, head_dim
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.compute_tables()

    def compute_tables(self) -> None:
        """Fill the fp32 cos/sin tables; again after the model was built on the meta device."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.config, self.head_dim).to(device)
        positions = torch.arange(self.cos.shape[0], dtype=torch.float32, device=device)
        emb = torch.cat((positions[:, None] * inv_freq[None, :],) * 2, dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D]: broadcast over heads.
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
