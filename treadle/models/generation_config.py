"""The model creator's generation defaults (its `generation_config.json`), applied as vLLM does.

vLLM's `generation_config="auto"` (its default) makes the sampling settings a model ships with the
defaults of every request that leaves them unset: temperature, top_p, top_k, min_p and
repetition_penalty. A request that sets a field keeps its own value. max_new_tokens bounds the
default length, as vLLM takes the least of the bounds: a request without max_tokens (offline,
or a chat request) runs to max_new_tokens or the end of the context, whichever comes first, and
an OpenAI completion's default of 16 is lowered to it. `"vllm"` (vLLM's name for its own
defaults) ignores them; a folder reads that folder's `generation_config.json` instead;
`override_generation_config` sets or replaces single keys, either way. As in vLLM, `do_sample`
is not read: a model whose file only says `do_sample: false` still samples at temperature 1.0
unless the request asks for greedy.

The file's `eos_token_id` may name several tokens (Llama 3 and Qwen2.5 chat models end a turn
with one and a document with another; without the file, config.json's). Each ends a request as
the tokenizer's EOS does; this holds whatever `generation_config` says, since it describes the
model, not a sampling taste.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from treadle.sampling_params import SamplingParams
from treadle.validate import json_dict

FILE = "generation_config.json"
# generation_config.json's keys that become request defaults (SamplingParams fields of the same
# names), and max_new_tokens.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
KEYS = SAMPLING_KEYS + ("max_new_tokens",)


@dataclass(frozen=True)
class GenerationDefaults:
    # SamplingParams field -> value, for every request that does not set that field.
    sampling: dict[str, Any] = field(default_factory=dict)
    # max_new_tokens: the most tokens a request that sets no max_tokens generates (None: no bound).
    max_tokens: int | None = None
    # Every token the model's generation config ends a sequence with.
    eos_token_ids: tuple[int, ...] = ()

    def sampling_params(self) -> SamplingParams:
        """A request's parameters when it gives none (vLLM's get_default_sampling_params)."""
        length = {"max_tokens": None} if self.max_tokens is not None else {}
        return SamplingParams(**self.sampling, **length)


def load_generation_defaults(model_dir: str, source: str = "auto",
                             overrides: dict[str, Any] | str | None = None,
                             config_eos: int | list[int] | None = None) -> GenerationDefaults:
    """The defaults from `source` ("auto": the model's folder; "vllm": none; or a folder holding
    a generation_config.json) with `overrides` (generation-config keys, or their JSON) on top;
    `config_eos`: config.json's eos_token_id, for a model without the file. Values are checked
    as SamplingParams checks them: a bad one is a ValueError naming it."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
    model_file = _read(os.path.join(model_dir, FILE))
    if source == "auto":
        chosen = model_file
    elif source == "vllm":
        chosen = {}
    else:
        path = os.path.join(source, FILE)
        if not os.path.isfile(path):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                             f"{FILE}; {source!r} has none")
        chosen = _read(path)
    values = {k: v for k, v in chosen.items() if k in KEYS and v is not None}
    if overrides is not None:
        values.update(json_dict("override_generation_config", overrides, KEYS))
    max_tokens = values.pop("max_new_tokens", None)
    try:
        SamplingParams(**values, max_tokens=max_tokens)
    except (TypeError, ValueError) as e:
        message = str(e).replace("max_tokens", "max_new_tokens")
        raise ValueError(f"the generation config's defaults are invalid: {message}") from None
    eos = next((f["eos_token_id"] for f in (chosen, model_file) if "eos_token_id" in f), config_eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        raise ValueError(f"{FILE}'s eos_token_id must be token ids >= 0, got {eos!r}")
    return GenerationDefaults(values, max_tokens, tuple(dict.fromkeys(eos_ids)))


def _read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data

