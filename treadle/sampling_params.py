"""Sampling parameters, with vLLM's names and meanings, normalised and validated on construction.

Every rejected value raises ValueError with a message that names the field, the allowed range
and the value given, e.g. "temperature must be >= 0, got -1".
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from treadle.structured_output.params import StructuredOutputsParams

# Below this temperature sampling is greedy (argmax), as in vLLM.
_GREEDY_EPS = 1e-5
# OpenAI's range for a logit_bias value: -100 bans a token, 100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0
FLOAT32_MAX = 3.4028234663852886e38
# Keeps |logit| * penalty and |logit| / penalty finite in float32 for any logit a model makes;
# penalties in use lie within [0.5, 2].
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"   # every output holds everything so far
    DELTA = "delta"             # every output holds only what is new since the last one
    FINAL_ONLY = "final_only"   # one output, when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x: Any) -> bool:
    # bool is an int subclass, but True as a count is always a mistake. numpy ints are welcome.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_unicode(text: str) -> bool:
    """False where `text` holds a lone surrogate, which UTF-8 (and so a tokenizer) cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(x: Any) -> str:
    """The value as a message shows it; the type too when the type is what is wrong."""
    if isinstance(x, (bool, str, list, tuple, dict, set)) or not isinstance(x, numbers.Number):
        return f"{x!r} ({type(x).__name__})"
    return repr(x)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 (or -1, normalised to 0) means off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16       # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None          # normalised to a list
    stop_token_ids: list[int] | None = None      # normalised to a list
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None       # top-N per generated token, plus the sampled one
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE
    # Token id -> a value in [-100, 100] added to that token's logit before penalties and
    # temperature (OpenAI's and vLLM's logit_bias); "123" keys, as JSON sends them, are read.
    logit_bias: dict[int, float] | None = None
    # Keep only the prompt's last k tokens (-1: the last max_model_len), as vLLM's.
    truncate_prompt_tokens: int | None = None
    # Words never to write, as vLLM's bad_words: a word's last token is banned wherever the
    # output ends with the rest of it (a one-token word everywhere); each is looked for as given
    # and with a leading space. The engine tokenizes them into `bad_words_token_ids`.
    bad_words: list[str] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # A JSON schema, regex, choice or grammar the output must follow (a dict is converted).
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # Free-form arguments for extensions, as in vLLM; a KV connector reads
    # extra_args["kv_transfer_params"] (what the prefill side handed back, for P/D), and
    # extra_args["speculative_decoding"] = False turns drafts off for this request.
    extra_args: dict[str, Any] | None = None
    # Set by the engine from bad_words and its tokenizer (InputProcessor.make_requests).
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._normalise_and_validate()

    # -- validation ----------------------------------------------------------------------------
    def _normalise_and_validate(self) -> None:
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        self.n = self._int("n", self.n, minimum=1)
        # The sampler divides by it in float32: past float32's largest it is inf, and NaNs follow.
        self.temperature = self._real("temperature", self.temperature,
                                      f">= 0 and at most {FLOAT32_MAX:.3g} (float32's largest)",
                                      lambda v: 0 <= v <= FLOAT32_MAX)
        self.top_p = self._real("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self.top_k = self._int("top_k", self.top_k, minimum=0,
                               rule="-1 or 0 (disabled) or a positive integer")
        self.min_p = self._real("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, self._real(name, getattr(self, name), "in [-2, 2]",
                                           lambda v: -2 <= v <= 2))
        # Logits are divided or multiplied by it in float32: far from 1 they overflow.
        self.repetition_penalty = self._real(
            "repetition_penalty", self.repetition_penalty,
            f"> 0, in [{REPETITION_PENALTY_RANGE[0]:g}, {REPETITION_PENALTY_RANGE[1]:g}]",
            lambda v: REPETITION_PENALTY_RANGE[0] <= v <= REPETITION_PENALTY_RANGE[1])
        if self.max_tokens is not None:
            self.max_tokens = self._int("max_tokens", self.max_tokens, minimum=1,
                                        rule="an integer >= 1 or None")
        self.min_tokens = self._int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if self.seed is not None:
            self.seed = self._int("seed", self.seed, rule="an integer or None")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, self._int(name, getattr(self, name), minimum=0,
                                              rule="an integer >= 0 or None"))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {_describe(getattr(self, name))}")
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._stop_token_ids(self.stop_token_ids)
        if self.truncate_prompt_tokens is not None and not (
                _is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens == -1):
            self.truncate_prompt_tokens = self._int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1,
                rule="-1 (the model's context), an integer >= 1 or None")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._allowed_token_ids(self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings or None, got "
                                 f"{_describe(self.bad_words)}")
            for word in self.bad_words:   # each is tokenized: half a surrogate pair cannot be
                if not _is_unicode(word):
                    raise ValueError(f"bad_words: {word!r} is not valid Unicode text")
            self.bad_words = list(self.bad_words)
        self.output_kind = self._output_kind(self.output_kind)
        self.logit_bias = self._logit_bias(self.logit_bias)
        self._structured_outputs()

    def _structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {_describe(self.structured_outputs)}")
        # The grammar decides where the output may end; these would overrule it.
        if self.min_tokens:
            raise ValueError("min_tokens must be 0 with structured_outputs (the grammar decides "
                             f"where the output may end), got {self.min_tokens}")
        if self.ignore_eos:
            raise ValueError("ignore_eos must be False with structured_outputs (the grammar "
                             "decides where the output may end)")

    @staticmethod
    def _int(name: str, value: Any, minimum: int | None = None, rule: str | None = None) -> int:
        rule = rule or (f"an integer >= {minimum}" if minimum is not None else "an integer")
        if not _is_int(value):  # a float here is a type error, so name the type
            raise ValueError(f"{name} must be {rule}, got {value!r} ({type(value).__name__})")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be {rule}, got {value!r}")
        return int(value)

    @staticmethod
    def _real(name: str, value: Any, rule: str, ok: Callable[[float], bool]) -> float:
        if not _is_real(value) or not ok(value):
            raise ValueError(f"{name} must be {rule}, got {_describe(value)}")
        # NaN fails every comparison, but inf can pass one; neither is ever meant.
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite and {rule}, got {value!r}")
        return float(value)

    @staticmethod
    def _stop_strings(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {_describe(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {_describe(s)}")
        return list(stop)

    @staticmethod
    def _stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0 or None, got {_describe(ids)}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold integers >= 0, got {_describe(t)}")
        return [int(t) for t in ids]

    @staticmethod
    def _allowed_token_ids(ids: Any) -> list[int]:
        rule = "a non-empty list of token ids >= 0 or None"
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"allowed_token_ids must be {rule}, got {_describe(ids)}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"allowed_token_ids must be {rule}, holding {_describe(t)}")
        return [int(t) for t in ids]

    @staticmethod
    def _logit_bias(bias: Any) -> dict[int, float] | None:
        """{token id: bias}, ids as ints (or decimal strings) >= 0, biases in [-100, 100]; the
        ids' upper bound, the vocabulary, is checked by the engine, which knows it."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias in "
                             f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] or None, "
                             f"got {_describe(bias)}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = key
            if isinstance(key, str) and key.strip().isdecimal() and len(key) < 20:
                token = int(key)
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), "
                                 f"got {_describe(key)}")
            if (not _is_real(value) or not math.isfinite(value)
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
                raise ValueError(f"logit_bias[{key!r}] must be in [-{LOGIT_BIAS_LIMIT:g}, "
                                 f"{LOGIT_BIAS_LIMIT:g}], got {_describe(value)}")
            if int(token) in out:
                raise ValueError(f"logit_bias names token {int(token)} twice")
            out[int(token)] = float(value)
        return out or None

    @staticmethod
    def _output_kind(kind: Any) -> RequestOutputKind:
        if isinstance(kind, RequestOutputKind):
            return kind
        allowed = ", ".join(k.value for k in RequestOutputKind)
        if isinstance(kind, str):
            try:
                return RequestOutputKind(kind.lower())
            except ValueError:
                pass
        raise ValueError(f"output_kind must be a RequestOutputKind or one of {allowed}, "
                         f"got {_describe(kind)}")

    # -- derived -------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without any)."""
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        """A deep copy, so changing the clone's lists never changes this one."""
        return copy.deepcopy(self)
