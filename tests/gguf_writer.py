"""Tiny GGUF files of each model family, written with the `gguf` package from a tiny HF
checkpoint (tests/tiny_models.py) the way llama.cpp's convert_hf_to_gguf.py writes that family:
its architecture name and metadata keys, tensor names from gguf's own name map, q/k rows
permuted for the `llama` architecture, Gemma's norms stored as 1 + weight, experts stacked
into one tensor per layer, Phi-3's fused q/k/v and gate/up kept fused and its LongRoPE factors
as tensors. Tensors are F32, so every weight is the checkpoint's, exactly.

The tokenizer is the embedded SmolLM2 GGUF's (the tiny checkpoints use its vocabulary), copied
field by field, cut to the model's vocabulary. `shrink_vocab` cuts a checkpoint's to its first
tokens first: gguf's reader and transformers' parse every token string and merge of a file,
~15 s a file (its config, tokenizer and weights read) at SmolLM2's 49,152 tokens and 48,900
merges, 2-3 s at 4,096; the tests feed token ids.

A checkpoint with a setting the converter drops without a trace is refused, so a test cannot
compare against a model the file does not describe. The one exception is the sliding window
of Mistral and Mixtral, which the converter drops silently from every real checkpoint:
treadle, like llama.cpp, then attends to all positions (loader._llama_arch_config).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable, Iterator

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from treadle.models.loader import default_model_path

# transformers model_type -> llama.cpp architecture.
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
              "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2",
              "gemma3_text": "gemma3"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# Per-expert parts (Qwen3-MoE's names, Mixtral's) -> the stacked tensor's part.
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}
# llama.cpp's local/global patterns (every 2nd or 6th layer global).
_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}


def write_gguf(hf_dir: str, path: str, name: str) -> str:
    """Write the checkpoint at `hf_dir` as a GGUF file at `path`, with `name` as general.name
    (transformers reads a llama file named exactly "mistral" as Mistral)."""
    config = AutoConfig.from_pretrained(hf_dir)
    arch = GGUF_ARCHS[config.model_type]
    _refuse_what_gguf_drops(config, arch)
    return write_gguf_of(config, path, name, _tensors(hf_dir, config, arch))


def write_gguf_of(config: Any, path: str, name: str,
                  tensors: Iterable[tuple[str, np.ndarray]] = ()) -> str:
    """Write `config`'s metadata, the tokenizer and `tensors` as a GGUF file at `path`; without
    tensors, a file for config readers alone (a shape too large to build)."""
    writer = gguf.GGUFWriter(path, GGUF_ARCHS[config.model_type])
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_hparams(writer, config, writer.arch)
    for key, value, vtype, sub_type in _tokenizer_fields(config.vocab_size):
        writer.add_key_value(key, value, vtype, sub_type)
    for tensor_name, data in tensors:
        writer.add_tensor(tensor_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refuse_what_gguf_drops(config: Any, arch: str) -> None:
    if arch in _GLOBAL_EVERY:
        head_dim = config.head_dim
        if config.query_pre_attn_scalar != head_dim:
            raise ValueError(f"query_pre_attn_scalar {config.query_pre_attn_scalar} != head_dim "
                             f"{head_dim}: llama.cpp assumes head_dim (but for the 27B models)")
        every = _GLOBAL_EVERY[arch]
        expected = ["sliding_attention" if (i + 1) % every else "full_attention"
                    for i in range(config.num_hidden_layers)]
        if config.layer_types != expected:
            raise ValueError(f"layer_types {config.layer_types}: llama.cpp assumes {expected}")
    if arch == "gemma2" and not config.tie_word_embeddings:
        raise ValueError("the converter drops Gemma 2's lm_head: llama.cpp assumes it tied")
    if arch == "qwen3moe" and config.mlp_only_layers:
        raise ValueError("mlp_only_layers: llama.cpp's qwen3moe has no dense layers")
    if arch == "qwen3moe" and not config.norm_topk_prob:
        raise ValueError("norm_topk_prob=False: llama.cpp always renormalises Qwen3-MoE's top-k")


def _rope_theta(config: Any) -> float:
    params = config.rope_parameters
    return float(params.get("full_attention", params)["rope_theta"])


def _add_hparams(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    if arch != "phi3":   # Phi-3's converter writes no head size
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "phi3":
        rope = config.rope_parameters
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        original = rope["original_max_position_embeddings"]
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.sliding_window or 0)   # 0: none
        if rope.get("long_factor"):
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)


def shrink_vocab(hf_dir: str, size: int) -> str:
    """Cut the checkpoint at `hf_dir` to its first `size` tokens (embedding and head rows)."""
    state = load_file(f"{hf_dir}/model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state:
            state[name] = state[name][:size].contiguous()
    save_file(state, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(hf_dir)
    config.vocab_size = size
    config.save_pretrained(hf_dir)
    return hf_dir


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(vocab_size: int
                      ) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """(key, value, type, item type) of each tokenizer.* field of the embedded GGUF, its token
    arrays cut to `vocab_size` and its merges to those of the tokens kept."""
    reader = gguf.GGUFReader(default_model_path())
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:vocab_size]
        fields.append((key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None))
    tokens = set(reader.fields["tokenizer.ggml.tokens"].contents()[:vocab_size])
    for i, (key, value, vtype, sub_type) in enumerate(fields):
        if key == "tokenizer.ggml.merges":
            kept = [m for m in value if {*m.split(" "), m.replace(" ", "")} <= tokens]
            fields[i] = (key, kept, vtype, sub_type)
    return fields


def _permute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from transformers' (2, half) order to llama.cpp's interleaved (half, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(hf_dir: str, config: Any, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    state = load_file(f"{hf_dir}/model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for hf_name, w in state.items():
        w = w.float()
        expert = _EXPERT.match(hf_name)
        if expert is not None:
            layer, e, part = expert.groups()
            experts.setdefault((int(layer), _EXPERT_PARTS[part]), {})[int(e)] = w
            continue
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            w = _permute_rope_rows(w, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            w = _permute_rope_rows(w, config.num_key_value_heads)
        if arch in _GLOBAL_EVERY and hf_name.endswith("norm.weight"):
            w = w + 1
        base, _, kind = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"gguf has no name for {hf_name!r} in {arch}")
        yield f"{gguf_name}.{kind}", w.numpy()
    for (layer, part), by_index in sorted(experts.items()):
        stacked = torch.stack([by_index[e] for e in range(len(by_index))])
        yield f"blk.{layer}.ffn_{part}_exps.weight", stacked.numpy()
    rope = config.rope_parameters
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)
