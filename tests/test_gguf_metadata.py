"""What a GGUF says beyond its weights, as llama.cpp's converter writes it, held to the
transformers checkpoint it came from (a helper's finds, each of which ran another model or
failed to load):

- a Llama 3.1/3.2 file's llama3 RoPE scaling is only its `rope_freqs.weight` tensor (a divisor
  per rotary pair), which the loader skips and nothing else in the file restates;
- `{arch}.rope.scaling.*` metadata (linear, or YaRN, refused by name), which transformers'
  reader maps for gpt-oss only;
- a Qwen3 head_dim other than Qwen3Config's 128 (`qwen3.attention.key_length`, which
  transformers maps for qwen3_moe only);
- q, k and v in different GGUF types (llama.cpp writes Mixtral's k and v in Q8_0 beside a
  Q4_0 q), which `quantization="gguf"` joined and crashed on.
"""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from transformers import AutoConfig

from tests import gguf_writer
from tests.family_support import PretrainedReference, greedy_ids
from tests.tiny_models import make_tiny_checkpoint
from treadle import LLM
from treadle.models import loader

ENGINE_ARGS = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 20,
               "max_num_batched_tokens": 32}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def conversions_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "gguf_cache_dir", lambda: str(tmp_path / "conv"))


def checkpoint(tmp_path, arch: str, **overrides) -> str:
    return gguf_writer.shrink_vocab(make_tiny_checkpoint(arch, tmp_path / "hf",
                                                         tie_word_embeddings=False, **overrides), 4096)


def write(hf: str, path: str, *, scaling: tuple | None = None, extra_tensors=(),
          type_of=None) -> str:
    """`hf` as a GGUF at `path`: with rope.scaling metadata (type, factor, original context),
    extra tensors, and each 2-D weight quantized to `type_of(name)` (None: float32)."""
    config = AutoConfig.from_pretrained(hf)
    arch = gguf_writer.GGUF_ARCHS[config.model_type]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if type_of else gguf.LlamaFileType.ALL_F32)
    gguf_writer._add_hparams(writer, config, writer.arch)
    if scaling is not None:
        kind, factor, original = scaling
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(factor)
        if original:
            writer.add_rope_scaling_orig_ctx_len(original)
    for key, value, vtype, sub_type in gguf_writer._tokenizer_fields(config.vocab_size):
        writer.add_key_value(key, value, vtype, sub_type)
    for name, data in [*gguf_writer._tensors(hf, config, arch), *extra_tensors]:
        data = np.ascontiguousarray(data, dtype=np.float32)
        kind = type_of(name) if type_of and data.ndim == 2 and "norm" not in name \
            and "token_embd" not in name else None
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_runs_as(reference: PretrainedReference, path: str, **engine_args) -> None:
    batch = [torch.randint(100, 4096, (n,), generator=torch.Generator().manual_seed(n)).tolist()
             for n in (20, 40)]
    want = [reference.greedy(p, 16) for p in batch]
    with LLM(path, **{**ENGINE_ARGS, **engine_args}) as llm:
        assert greedy_ids(llm, batch, 16) == want


def llama_cpp_rope_factors(config) -> np.ndarray:
    """What convert_hf_to_gguf.py writes as rope_freqs for rope_type llama3."""
    base, dim = config.rope_parameters["rope_theta"], config.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low = LLAMA3_ROPE["factor"], LLAMA3_ROPE["low_freq_factor"]
    high, old = LLAMA3_ROPE["high_freq_factor"], LLAMA3_ROPE["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def test_llama3_rope_comes_from_the_rope_freqs_tensor(tmp_path):
    # An original context of 64, so that the scaling reaches what short prompts exercise.
    hf = checkpoint(tmp_path, "llama", rope_scaling=dict(LLAMA3_ROPE))
    factors = llama_cpp_rope_factors(AutoConfig.from_pretrained(hf))
    path = write(hf, str(tmp_path / "g" / "l.gguf"), extra_tensors=[("rope_freqs.weight", factors)])
    assert_runs_as(PretrainedReference(hf), path)


def test_linear_rope_scaling_in_the_metadata_is_applied(tmp_path):
    hf = checkpoint(tmp_path, "llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = write(hf, str(tmp_path / "g" / "l.gguf"), scaling=(gguf.RopeScalingType.LINEAR, 4.0, None))
    assert_runs_as(PretrainedReference(hf), path)


def test_yarn_in_the_metadata_is_refused_by_name(tmp_path):
    hf = checkpoint(tmp_path, "qwen2")
    path = write(hf, str(tmp_path / "g" / "q.gguf"), scaling=(gguf.RopeScalingType.YARN, 4.0, 256))
    with pytest.raises(ValueError, match="yarn"):
        LLM(path, **ENGINE_ARGS).shutdown()


def test_a_qwen3_head_dim_other_than_128(tmp_path):
    hf = checkpoint(tmp_path, "qwen3")
    path = gguf_writer.write_gguf(hf, str(tmp_path / "g.gguf"), "Tiny qwen3")
    assert loader.load_hf_config(path).head_dim == 16
    assert_runs_as(PretrainedReference(hf), path)


def test_parts_of_a_fused_weight_in_other_types_run_unquantized(tmp_path):
    hf = checkpoint(tmp_path, "llama")
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    path = write(hf, str(tmp_path / "g" / "tiny.gguf"),
                 type_of=lambda name: q8 if ".attn_k." in name or ".attn_v." in name else q4)
    # transformers on the dequantized weights
    assert_runs_as(PretrainedReference(loader.prepare_model(path)), path, quantization="gguf")
