"""What users get back: `RequestOutput` holding one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has no logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    weight_version: Any = None        # the engine's weights when this output was produced
    kv_transfer_params: dict | None = None   # from the KV connector, once finished (P/D)
