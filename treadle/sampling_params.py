"""Sampling parameters, with vLLM's names and meanings, validated on construction."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"   # every output holds everything so far
    DELTA = "delta"             # every output holds only what is new
    FINAL_ONLY = "final_only"   # one output, at the end


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 (or -1) means off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16       # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None       # top-N per generated token, plus the sampled one
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if isinstance(self.output_kind, str):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError("output_kind must be one of cumulative, delta, final_only, "
                                 f"got {self.output_kind!r}") from None

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(_is_number(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and self.top_k >= 0,
             f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        need(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        need(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        need(_is_int(self.min_tokens) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or (_is_int(value) and value >= 0),
                 f"{name} must be an integer >= 0 (or None), got {value!r}")
        for s in self.stop:
            need(isinstance(s, str) and s != "", f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            need(_is_int(t) and t >= 0, f"stop_token_ids must hold integers >= 0, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
