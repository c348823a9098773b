"""Architecture name (from config.json or GGUF metadata) -> model class."""

from __future__ import annotations

from torch import nn

from treadle.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def get_model_class(hf_config) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        names.append(_MODEL_TYPES[model_type])
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(f"unsupported architecture {names or model_type!r}; "
                     f"supported: {', '.join(sorted(_ARCHITECTURES))}")
