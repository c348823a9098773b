"""Architecture name (from config.json or GGUF metadata) -> model class."""

from __future__ import annotations

from torch import nn

from treadle.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from treadle.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                  Qwen3ForCausalLM)
from treadle.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from treadle.models.phi3 import Phi3ForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def get_model_class(hf_config) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        names.append(_MODEL_TYPES[model_type])
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    if model_type == "gemma3":
        # Its weights sit under the multimodal model's names (language_model.*), beside a
        # vision tower.
        raise ValueError("Gemma 3 with a vision tower (model_type 'gemma3') is not supported; "
                         "treadle runs Gemma 3's text-only checkpoints (Gemma3ForCausalLM, "
                         "model_type 'gemma3_text')")
    raise ValueError(f"unsupported architecture {names or model_type!r}; "
                     f"supported: {', '.join(sorted(_ARCHITECTURES))}")
