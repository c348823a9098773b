"""A GGUF file's config: transformers reads a GGUF's metadata into a config key by key, and for
Phi-3, Gemma 2/3, Qwen3-MoE and the `llama` architecture's Mistral and Mixtral it drops or guesses
what the file (or llama.cpp, which runs it) does say. `complete_gguf_config` sets those from the
file, so treadle runs the model llama.cpp runs from the same file. models/loader.py reads the
weights.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# Phi-3's LongRoPE factors: tensors in the file, lists in the config.
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def gguf_field(reader: GGUFReader, key: str) -> Any:
    """A metadata field's value, or None where the file has none."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as fp32 torch, outermost dimension first."""
    from gguf.quants import dequantize as gguf_dequantize

    data = gguf_dequantize(tensor.data, tensor.tensor_type)
    # F32 tensors come back as views of the read-only file map: copy those into our memory.
    data = data.astype(np.float32, copy=not data.flags.writeable)
    # GGUF lists dims innermost first (ne0, ne1, ...); torch wants outermost first.
    return torch.from_numpy(data.reshape([int(d) for d in reversed(tensor.shape)]))


# Gemma's attention scale is not written: llama.cpp takes head_dim ** -0.5, except for the
# 27B models (known by their layer count), which take (hidden / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's local/global layer patterns: every 2nd (Gemma 2) or 6th (Gemma 3) layer global,
# and Gemma 3's local RoPE base, when the file does not give them.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def complete_gguf_config(config: PretrainedConfig, reader: GGUFReader) -> PretrainedConfig:
    """`config` (transformers' reading of the GGUF) with what else the file says."""
    arch = gguf_field(reader, "general.architecture")
    meta = functools.partial(_gguf_arch_field, reader, arch)
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
        _rope_scaling(config, meta)
    if arch == "llama":
        # Llama 3.1+'s llama3 RoPE scaling: one factor per rotary pair, as a tensor (llama.cpp
        # divides each frequency by it); the metadata says nothing of it.
        factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if factors is not None:
            config.rope_freq_factors = dequantize(factors).tolist()
        return _llama_arch_config(config, meta)
    if arch == "qwen3":
        # transformers maps no key to Qwen3's head_dim, which then stays Qwen3Config's 128
        key_length = meta("attention.key_length")
        if key_length is not None:
            config.head_dim = int(key_length)
    if arch == "qwen3moe":
        # Experts on every layer: llama.cpp's qwen3moe has no dense layers (nor a name for
        # their tensors), so a checkpoint with `mlp_only_layers` does not convert.
        config.moe_intermediate_size = int(meta("expert_feed_forward_length"))
        norm = meta("expert_weights_norm")
        config.norm_topk_prob = True if norm is None else bool(norm)   # llama.cpp: always
    elif arch == "phi3":
        _phi3_rope(config, reader, meta)
    elif arch in _GEMMA_27B_LAYERS:
        _gemma_config(config, arch, meta)
    return config


def _rope_scaling(config: PretrainedConfig, meta: Any) -> None:
    """The RoPE scaling the file states (`rope.scaling.*`), which transformers' reader drops:
    linear is applied; any other type (yarn) is kept, for rope.py to refuse by name."""
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return
    params = dict(getattr(config, "rope_parameters", None) or {})
    params["rope_type"] = str(kind)
    if meta("rope.scaling.factor") is not None:
        params["factor"] = float(meta("rope.scaling.factor"))
    if meta("rope.scaling.original_context_length") is not None:
        params["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length"))
    config.rope_parameters = params


def _gguf_arch_field(reader: GGUFReader, arch: str, key: str) -> Any:
    return gguf_field(reader, f"{arch}.{key}")


def _llama_arch_config(config: PretrainedConfig, meta: Any) -> PretrainedConfig:
    """Llama, Mistral and Mixtral all convert to llama.cpp's `llama` architecture.

    Mixtral is the one with experts. None of them records a sliding window, and llama.cpp
    attends to every position; so does treadle (transformers, for a file whose name is exactly "mistral",
    assumes MistralConfig's 4096-token window instead). Mistral-7B-v0.1's own 4096-token window
    is lost this way: past 4096 tokens its GGUF computes what llama.cpp computes, not what the
    HF checkpoint does.
    """
    from transformers import MixtralConfig

    if getattr(config, "sliding_window", None) is not None:
        logger.warning("GGUF files of the llama architecture record no sliding window; attending "
                       "to all positions as llama.cpp does (not transformers' guess of %d)",
                       config.sliding_window)
        config.sliding_window = None
    experts = meta("expert_count")
    if not experts:
        return config
    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
    fields.update(num_local_experts=int(experts), num_experts_per_tok=int(meta("expert_used_count")),
                  sliding_window=None, architectures=["MixtralForCausalLM"])
    return MixtralConfig(**fields)


def _phi3_rope(config: PretrainedConfig, reader: GGUFReader, meta: Any) -> None:
    """Phi-3's partial RoPE, LongRoPE factors (two tensors) and sliding window (0: none)."""
    head_dim = config.hidden_size // config.num_attention_heads
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base") or 10000.0)}
    dims = meta("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        rope["partial_rotary_factor"] = int(dims) / head_dim
        config.partial_rotary_factor = rope["partial_rotary_factor"]
    factors = {t.name: t for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}
    if "rope_factors_long.weight" in factors:
        original = int(meta("rope.scaling.original_context_length"))
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=dequantize(factors["rope_factors_long.weight"]).tolist(),
                    short_factor=dequantize(factors["rope_factors_short.weight"]).tolist())
        attn_factor = meta("rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
        config.original_max_position_embeddings = original
    config.rope_parameters = rope
    config.sliding_window = int(meta("attention.sliding_window") or 0) or None


def _gemma_config(config: PretrainedConfig, arch: str, meta: Any) -> None:
    """Gemma's attention scale, soft-capping, local/global layers and RoPE bases."""
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    head_dim = int(meta("attention.key_length") or hidden // heads)
    config.head_dim = head_dim
    config.query_pre_attn_scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    config.attn_logit_softcapping = meta("attn_logit_softcapping")
    config.final_logit_softcapping = meta("final_logit_softcapping")
    window = meta("attention.sliding_window")
    config.sliding_window = int(window) if window else None
    pattern = meta("attention.sliding_window_pattern")
    if window is None:
        local = [False] * layers
    elif isinstance(pattern, list):
        local = [bool(p) for p in pattern]
    else:
        every = int(pattern) if pattern else _GEMMA_GLOBAL_EVERY[arch]
        local = [(i + 1) % every != 0 for i in range(layers)]
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in local]
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base") or 1000000.0)}
        if meta("rope.scaling.type") == "linear":
            full.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
        local_base = meta("rope.freq_base_swa") or _GEMMA3_LOCAL_ROPE_BASE
        config.rope_parameters = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(local_base)}}
