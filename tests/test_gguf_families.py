"""GGUF files of the families llama.cpp's converter writes beyond Llama/Qwen2/Qwen3: Mistral and
Mixtral (its `llama` architecture, Mixtral's experts stacked), Qwen3-MoE, Phi-3 (fused weights,
LongRoPE factors as tensors, partial RoPE) and Gemma 2 / 3 (norms stored as 1 + weight), each
written from a tiny HF checkpoint by tests/gguf_writer.py.

Each file's weights and config are the checkpoint's, and treadle's greedy fp32 output from the
file is token-identical to transformers': loading the same file where transformers reads that
family's GGUF faithfully (Mistral), else loading the HF folder the file was written from.
transformers' own GGUF reader gets the others wrong: it reads a Mixtral file as a dense Llama,
takes Qwen3-MoE's expert width from Qwen3MoeConfig's default rather than the file, drops
Phi-3's LongRoPE factors and partial RoPE, and takes Gemma's attention scale and soft-capping
from the config class's defaults rather than the file.

The checkpoints keep to what a GGUF can say (gguf_writer refuses the rest): Qwen3-MoE with
experts on every layer, renormalised; Gemma with llama.cpp's attention scale (head_dim) and
layer patterns, Gemma 2 tied.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.family_support import MAX_TOKENS, PretrainedReference, greedy_ids, tight_for
from tests.gguf_writer import shrink_vocab, write_gguf, write_gguf_of
from tests.tiny_models import make_tiny_checkpoint
from treadle import LLM
from treadle.models import loader
from treadle.models.loader import iter_hf_weights, load_hf_config
from treadle.models.moe import expert_weights
from treadle.models.rope import RotaryEmbedding

VOCAB = 4096
# family -> (tiny arch, tied head, config overrides that keep it to what a GGUF can say).
FAMILIES = {
    "mistral": ("mistral", False, {}),
    "mixtral": ("mixtral", False, {}),
    "qwen3_moe": ("qwen3_moe", False, {"mlp_only_layers": [], "norm_topk_prob": True}),
    "phi3": ("phi3", False, {}),
    "gemma2": ("gemma2", True, {"query_pre_attn_scalar": 16}),
    # llama.cpp's Gemma 3 layers: five local to one global, so all three are local here.
    "gemma3": ("gemma3", False, {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention"] * 3}),
}
# Families whose GGUF transformers reads faithfully: the reference loads the file itself.
TRANSFORMERS_READS_THE_FILE = {"mistral"}
# What each family's model reads from its config beyond the shapes, to be the checkpoint's.
CONFIG_FIELDS = {
    "mistral": (),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "mlp_only_layers"),
    "phi3": ("original_max_position_embeddings", "sliding_window"),
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
               "sliding_window", "layer_types"),
    "gemma3": ("query_pre_attn_scalar", "final_logit_softcapping", "sliding_window", "layer_types",
               "rope_parameters"),
}
SHAPES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
          "tie_word_embeddings")


@pytest.fixture(scope="module", autouse=True)
def _own_conversions(tmp_path_factory):
    """Conversions into a folder of this module's own: a file's content key must not find a
    folder an earlier loader converted. (Only that folder: the kernels' cache stays, built.)"""
    folder = str(tmp_path_factory.mktemp("gguf-conversions"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "gguf_cache_dir", lambda: folder)
        yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str, str]:
    """(family, HF folder, GGUF file): the file in a folder of its own, since transformers
    prefers a folder's tokenizer files to the GGUF's."""
    name = request.param
    arch, tied, overrides = FAMILIES[name]
    root = tmp_path_factory.mktemp(f"gguf-{name}")
    hf_dir = shrink_vocab(make_tiny_checkpoint(arch, root / "hf", tie_word_embeddings=tied, **overrides),
                          VOCAB)
    os.makedirs(root / "gguf")
    return name, hf_dir, write_gguf(hf_dir, str(root / "gguf" / f"{name}.gguf"), f"Tiny {name}")


def prompts() -> list[list[int]]:
    """Three prompts of 30, 47 and 64 tokens: past Gemma's 24-token window."""
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(100, VOCAB, (30 + 17 * i,), generator=gen).tolist() for i in range(3)]


def test_weights_are_the_checkpoints(family):
    """Every weight, bit for bit: q/k rows un-permuted, experts unstacked, Phi-3's fused
    weights kept fused; Gemma's norms come back as the converter's (w + 1) - 1 in fp32."""
    name, hf_dir, path = family
    ours = dict(iter_hf_weights(path, load_hf_config(path)))
    theirs = dict(expert_weights(load_file(os.path.join(hf_dir, "model.safetensors")).items()))
    assert set(ours) == set(theirs)
    gemma = name.startswith("gemma")
    for key, tensor in theirs.items():
        expected = (tensor + 1) - 1 if gemma and key.endswith("norm.weight") else tensor
        assert torch.equal(ours[key], expected), key


def _f32(value: Any) -> Any:
    """`value` with its floats as the float32 a GGUF stores them in (what the model computes
    with), in dicts and lists too."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _f32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_f32(v) for v in value]
    return value


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def test_config_is_the_checkpoints(family):
    """The settings each family's model reads, as the checkpoint has them, from the file;
    Phi-3's RoPE tables (LongRoPE's short factors and attention factor, over half of each
    head) bit for bit. A Mistral file is a Llama one: llama.cpp's architecture."""
    name, hf_dir, path = family
    ours, theirs = load_hf_config(path), transformers.AutoConfig.from_pretrained(hf_dir)
    assert type(ours).__name__ == ("LlamaConfig" if name == "mistral" else type(theirs).__name__)
    for field in SHAPES + CONFIG_FIELDS[name]:
        assert _f32(getattr(ours, field, None)) == _f32(getattr(theirs, field, None)), field
    assert _head_dim(ours) == _head_dim(theirs)
    if name == "phi3":
        tables = [RotaryEmbedding(c, 16, 1024) for c in (ours, theirs)]
        assert tables[0].dim == tables[1].dim == 8
        assert torch.equal(tables[0].cos, tables[1].cos) and torch.equal(tables[0].sin, tables[1].sin)


def test_mistral_attends_to_every_position_as_llama_cpp(tmp_path, caplog):
    """A llama-architecture file records no sliding window. Named exactly "mistral",
    transformers reads it as Mistral with MistralConfig's 4096-token window; treadle attends
    to every position, as llama.cpp does, and says so."""
    arch, tied, overrides = FAMILIES["mistral"]
    hf_dir = shrink_vocab(make_tiny_checkpoint(arch, tmp_path / "hf", tie_word_embeddings=tied), VOCAB)
    os.makedirs(tmp_path / "gguf")
    path = write_gguf(hf_dir, str(tmp_path / "gguf" / "m.gguf"), "mistral")
    with caplog.at_level(logging.WARNING, logger="treadle.models.loader"):
        config = load_hf_config(path)
    assert config.model_type == "mistral" and config.sliding_window is None
    assert "record no sliding window" in caplog.text


@pytest.mark.parametrize("arch, layers, every, scalar", [
    ("gemma2", 12, 2, 32), ("gemma3", 12, 6, 32),
    ("gemma2", 46, 2, 16), ("gemma3", 62, 6, 16)])   # the 27B models' layer counts
def test_gemma_layers_and_scale_are_llama_cpps(tmp_path, arch, layers, every, scalar):
    """A Gemma GGUF holds neither the layer types nor the attention scale: as llama.cpp does,
    every 2nd (Gemma 2) or 6th (Gemma 3) layer is global, and the scale is head_dim ** -0.5
    but for the 27B models' (hidden / heads) ** -0.5. Checked on files of metadata alone."""
    config_class = {"gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[arch]
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=24)
    os.makedirs(tmp_path / "gguf")
    ours = load_hf_config(write_gguf_of(config, str(tmp_path / "gguf" / "g.gguf"), "Tiny gemma"))
    assert ours.layer_types == ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                for i in range(layers)]
    assert ours.query_pre_attn_scalar == scalar and ours.sliding_window == 24


class GgufReference(PretrainedReference):
    """transformers' model loaded from the GGUF file itself."""

    def __init__(self, path: str) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def test_greedy_matches_transformers(family):
    """Batched and in chunks (TIGHT), treadle on the file against transformers on the
    same file (Mistral) or on the HF folder it was written from (the others: see the module's
    docstring for why)."""
    name, hf_dir, path = family
    batch = prompts()
    if name in TRANSFORMERS_READS_THE_FILE:
        ref = GgufReference(path)
    else:
        ref = PretrainedReference(hf_dir)
    want = [ref.greedy(p, MAX_TOKENS) for p in batch]
    with LLM(path, dtype="float32", **tight_for(hf_dir)) as llm:
        assert greedy_ids(llm, batch) == want
