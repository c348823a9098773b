"""Tiny random Llama / Qwen2 / Qwen3 checkpoints (and Qwen3-MoE / Mixtral), saved as real HF
folders for tests.

Each folder (config.json, model.safetensors, the SmolLM2 tokenizer and chat template) loads
like any local model. Shapes: hidden 64, 3 layers, 4 query heads sharing 2 KV heads (GQA),
head_dim 16, MLP 128, vocab 49152 (the tokenizer's), 1024 positions. Where the embedded model
is not installed (the GPU machines carry no copy of it), the tokenizer is a byte-level BPE of
the same size trained on the docs: the tests that run there compare token ids only.

Random weights at the default init (std 0.02) give nearly flat logits, and greedy argmax
then flips on float noise. So the init is larger, and the head's rows get log-normal norms:
a few tokens then win clearly at each step (the smallest top-1/top-2 logit gap over 5x64
greedy steps grows 30-60x, to ~1e-2 logit std and more), while the hidden state still moves
enough that greedy text does not settle on one token. Norm weights and biases are
randomised too, so a loader or model that drops them cannot pass unnoticed.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from treadle.models.loader import default_model_path, load_tokenizer

ARCHS = ("llama", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral")
# Phi-3 with LongRoPE (an original context of 256 of 1,024 positions), RoPE over half of each head
# (as Phi-4-mini over three quarters), and Mistral with a window wider than the tests' prompts.
OTHER_ARCHS = ("phi3", "mistral")
# Gemma 2 and 3 with 24-token windows, shorter than the tests' prompts, on local layers around a
# global one; Gemma 2 soft-caps scores and logits, Gemma 3 has two RoPE bases.
GEMMA_ARCHS = ("gemma2", "gemma3")

# arch -> (config class, model class, arch-specific config). Different rope_theta per arch,
# so a model that ignores the config's value fails on at least two of them.
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),  # q/k/v bias
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 500000.0}),  # q/k RMSNorm
    # Mixtures of experts: 4 experts, 2 per token. Qwen3-MoE's middle layer is a dense MLP
    # (mlp_only_layers), so one model holds both kinds; its top-k weights are not renormalised
    # (norm_topk_prob=False), Mixtral's always are.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"rope_theta": 1000000.0, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"rope_theta": 1000000.0, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 256,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(4)],
                               "long_factor": [2.0 + 0.5 * i for i in range(4)]}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"rope_theta": 1000000.0, "sliding_window": 512}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"rope_theta": 10000.0, "sliding_window": 24, "query_pre_attn_scalar": 24,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 24, "query_pre_attn_scalar": 24,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}
# llama is tied unless asked otherwise: the shared fixtures then cover both head layouts.
_TIED_BY_DEFAULT = {"llama"}

# Tuned on greedy 64-token runs from 5 prompts (see the module docstring). A tied head is
# also the input embedding, so it takes a milder spread: wider norms make the model echo
# its own input token forever.
_INIT_STD = {False: 0.2, True: 0.3}
_HEAD_ROW_LOG_STD = {False: 1.0, True: 0.5}


def tiny_config(arch: str, tokenizer, *, tie_word_embeddings: bool, **overrides):
    """The transformers config for one tiny architecture, ids taken from the tokenizer;
    `overrides` replace the arch's own settings."""
    import transformers

    config_name, _, extra = _ARCHS[arch]
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-6, initializer_range=_INIT_STD[tie_word_embeddings],
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return getattr(transformers, config_name)(**{**fields, **extra, **overrides})


@torch.no_grad()
def _sharpen(model: torch.nn.Module, init_std: float, head_row_log_std: float) -> None:
    """Randomise norms and biases (init leaves them 1 and 0) and spread the head's row norms."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5)
        elif name.endswith(".bias"):
            param.normal_(0.0, init_std)
    head = model.get_output_embeddings().weight  # the embedding itself when tied
    head.mul_(torch.exp(head_row_log_std * torch.randn(head.shape[0], 1)))


def make_tiny_checkpoint(arch: str, path: str | os.PathLike, *,
                         tie_word_embeddings: bool | None = None, seed: int = 0, **overrides) -> str:
    """Build a random `arch` model and save it with its tokenizer as an HF folder at `path`.

    tie_word_embeddings=None takes the arch's default (llama tied, qwen2/qwen3 not); `overrides`
    are config settings (a shorter sliding_window, say).
    """
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    tied = arch in _TIED_BY_DEFAULT if tie_word_embeddings is None else tie_word_embeddings
    tokenizer = _tokenizer()
    config = tiny_config(arch, tokenizer, tie_word_embeddings=tied, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCHS[arch][1])(config).eval()
    _sharpen(model, _INIT_STD[tied], _HEAD_ROW_LOG_STD[tied])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def word_level_tokenizer(vocab_size: int):
    """A tokenizer over the words w0.. w{vocab_size - 1} (w0 unknown, w1 bos, w2 eos), for
    models whose text nobody reads."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1",
                                                eos_token="w2", unk_token="w0")


@functools.lru_cache(maxsize=None)
def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE trained on this project's README and docs (merges up to 8,192 tokens;
    0 unknown, 1 bos, 2 eos), the rest of the vocabulary filler. English encodes to 1.3-1.6
    times as many tokens as with SmolLM2's tokenizer, and any text to decodable ids, whatever
    tokenizer class transformers picks for the model type (Qwen2's rebuilds the BPE from the
    vocabulary and merges, and encodes anything with a word-level model to nothing).
    Training is deterministic; cached, as every tiny checkpoint saves one."""
    import json

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(__file__).resolve().parents[1]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.train([str(root / "README.md"), *map(str, sorted((root / "docs").glob("*.md")))],
              trainers.BpeTrainer(vocab_size=min(vocab_size, 8192), show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    trained = json.loads(tok.to_str())["model"]
    vocab = trained["vocab"]
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # pad named: else Qwen2's tokenizer class adds one past the model's vocabulary
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>", pad_token="</s>")


def _tokenizer():
    """The embedded SmolLM2's tokenizer, or a byte-level one of its size where the package that
    holds it is missing (the GPU machines; `make install` always installs it)."""
    try:
        path = default_model_path()
    except RuntimeError:
        return byte_level_tokenizer(49152)
    return load_tokenizer(path)


_BUILT: dict[tuple[str, bool | None, int], str] = {}


def tiny_checkpoint_dir(arch: str, tmp_path_factory, *,
                        tie_word_embeddings: bool | None = None, seed: int = 0) -> str:
    """make_tiny_checkpoint, built once per test session per (arch, tying, seed).

    Call it from a session- or module-scoped fixture with pytest's `tmp_path_factory`.
    """
    key = (arch, tie_word_embeddings, seed)
    path = _BUILT.get(key)
    if path is None or not os.path.isdir(path):  # a new session's temp root replaces the old
        tie = {None: "default", True: "tied", False: "untied"}[tie_word_embeddings]
        folder = tmp_path_factory.mktemp(f"tiny-{arch}-{tie}-{seed}", numbered=True)
        path = _BUILT[key] = make_tiny_checkpoint(
            arch, folder, tie_word_embeddings=tie_word_embeddings, seed=seed)
    return path
