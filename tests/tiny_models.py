"""Tiny random Llama / Qwen2 / Qwen3 checkpoints, saved as real HF folders for tests.

The default init (std 0.02) gives nearly flat logits, where greedy argmax flips on float noise;
a larger init gives clear margins, so token-exact comparisons test the engine, not rounding.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from treadle.models.loader import default_model_path, load_tokenizer

_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 500000.0}),
}


def make_tiny_checkpoint(arch: str, path: str | os.PathLike, *, seed: int = 0) -> str:
    import transformers

    config_name, model_name, extra = _ARCHS[arch]
    tokenizer = load_tokenizer(default_model_path())
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
