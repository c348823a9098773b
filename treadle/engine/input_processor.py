"""Prompts in, engine-core `Request`s out: tokenize, validate, fan out n > 1."""

from __future__ import annotations

import itertools
from typing import Any, Union

from treadle.config import TreadleConfig
from treadle.models.loader import default_eos_token_id
from treadle.request import Request
from treadle.sampling_params import SamplingParams
from treadle.structured_output.reasoning import prompt_opens_reasoning, reasoning_end_token_ids
from treadle.structured_output.registry import backend_class

PromptType = Union[str, list[int], dict[str, Any]]

MAX_LOGPROBS = 20


class InputProcessor:
    def __init__(self, config: TreadleConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # Engine-core ids are the client's id and a number never repeated (invariant 6): what
        # is still in flight for an ended request (a step, a KV load or send, a compile) can
        # never be taken for a new request that reuses its id.
        self._tenancies = itertools.count()
        self.vocab_size = config.model.vocab_size
        self.eos_token_id = default_eos_token_id(tokenizer, config.model.hf_config)
        # The other tokens the model's generation config ends a sequence with: each request
        # stops at them too, as stop tokens (unless ignore_eos), as in vLLM.
        self.more_eos_token_ids = [t for t in config.model.generation.eos_token_ids
                                   if t != self.eos_token_id and t < self.vocab_size]
        structured = config.structured_outputs
        # The tokens a grammar waits for before it binds (empty: it binds from the first token).
        self.reasoning_end: tuple[int, ...] = ()
        if structured.reasoning_parser is not None and not structured.enable_in_reasoning:
            self.reasoning_end = reasoning_end_token_ids(tokenizer, structured.reasoning_parser)

    def grammar_waits(self, prompt: str, reasoning: bool | None = None) -> bool:
        """Whether a grammar on this prompt's output waits for the end of the reasoning: where
        the output starts inside it, as `reasoning` says (a request's extra_args["reasoning"]),
        or if that is unset, as the prompt's last tag says."""
        if not self.reasoning_end:
            return False
        if reasoning is None:
            reasoning = prompt_opens_reasoning(prompt, self.config.structured_outputs.reasoning_parser)
        return bool(reasoning)

    @staticmethod
    def needs_tokenizer(prompt: PromptType) -> bool:
        """Whether tokenize(prompt) runs the tokenizer: a text without its token ids."""
        return isinstance(prompt, str) or (isinstance(prompt, dict)
                                           and "prompt_token_ids" not in prompt)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Accepts a str, {"prompt": str}, {"prompt_token_ids": [...]} or a list of token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            if not text:
                raise ValueError("prompt must not be empty")
            try:
                ids = self.tokenizer.encode(text)
            except (TypeError, UnicodeError) as e:   # e.g. a lone surrogate code point
                raise ValueError(f"prompt cannot be tokenized: {e}") from None
        ids = list(ids)
        if not ids:
            raise ValueError("prompt must not be empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {self.vocab_size})")
        return text, ids

    def truncate(self, text: str | None, ids: list[int], params: SamplingParams
                 ) -> tuple[str | None, list[int]]:
        """The prompt cut to its last truncate_prompt_tokens tokens (-1: max_model_len); its
        text is then no longer the prompt's (None: decoded where needed)."""
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.config.model.max_model_len
        if keep is None or len(ids) <= keep:
            return text, ids
        return None, ids[-keep:]

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as written (leading spaces dropped) and, where they differ, with a
        leading space, as a word inside a sentence is written."""
        out: list[list[int]] = []
        for word in words:
            for spelling in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(spelling, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Raises ValueError for parameters this model cannot take, or a prompt too long."""
        self.validate_sampling(params)
        self.validate_length(params, num_prompt_tokens)

    def validate_sampling(self, params: SamplingParams) -> None:
        """The checks that do not depend on the prompt: once for a batch of prompts."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for t in params.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary [0, {self.vocab_size})")
        for t in params.allowed_token_ids or ():
            if t >= self.vocab_size:
                raise ValueError(f"allowed_token_ids names token {t}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        for word in params.bad_words or ():
            if any(t >= self.vocab_size for ids in self.bad_words_token_ids([word]) for t in ids):
                raise ValueError(f"bad_words: {word!r} has tokens outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        for t in params.logit_bias or ():
            if t >= self.vocab_size:
                raise ValueError(f"logit_bias names token {t}, outside the vocabulary [0, {self.vocab_size})")
        reasoning = (params.extra_args or {}).get("reasoning")
        if reasoning is not None and not isinstance(reasoning, bool):
            raise ValueError(f"extra_args['reasoning'] must be true or false (whether the output "
                             f"starts inside the reasoning), got {reasoning!r}")
        kv_params = (params.extra_args or {}).get("kv_transfer_params")
        if kv_params is not None and not isinstance(kv_params, dict):
            raise ValueError(f"kv_transfer_params must be an object (what a KV connector handed "
                             f"back), got {type(kv_params).__name__}")
        if params.structured_outputs is not None:   # the engine's message, before the engine
            backend_class(self.config.structured_outputs.backend).validate(params.structured_outputs)

    def validate_length(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """The prompt, and max_tokens after it, within max_model_len."""
        max_len = self.config.model.max_model_len
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens; it must be shorter than max_model_len "
                f"({max_len}) to leave room for output")
        max_tokens = params.max_tokens
        if max_tokens is not None and num_prompt_tokens + max_tokens > max_len:
            # vLLM's wording, which clients parse for the numbers; plus the field and its range.
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                f"messages or completion: max_tokens must be in [1, "
                f"{max_len - num_prompt_tokens}] for this prompt, got {max_tokens}.")

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      priority: int = 0, cache_salt: str | None = None,
                      arrival_time: float | None = None,
                      prompt_text: str | None = None) -> list[Request]:
        """One engine-core request per sample; with n > 1 they share the prompt's cached blocks.
        `prompt_text`: the prompt's text, if at hand (else decoded where needed)."""
        self.validate_params(params, len(prompt_token_ids))
        grammar_waits_for: tuple[int, ...] = ()
        if params.structured_outputs is not None and self.reasoning_end:
            if prompt_text is None:
                prompt_text = self.tokenizer.decode(prompt_token_ids)
            if self.grammar_waits(prompt_text, (params.extra_args or {}).get("reasoning")):
                grammar_waits_for = self.reasoning_end
        missing = [t for t in self.more_eos_token_ids if t not in params.stop_token_ids]
        if (missing and not params.ignore_eos) or params.bad_words:
            params = params.clone()
        if missing and not params.ignore_eos:
            params.stop_token_ids = params.stop_token_ids + missing
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        # No max_tokens: the room left in the context, as in vLLM, or the model's
        # max_new_tokens if that is less.
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.model.max_model_len - len(prompt_token_ids)
            if (bound := self.config.model.generation.max_tokens) is not None:
                max_tokens = min(max_tokens, bound)
        requests = []
        tenancy = f"{request_id}-{next(self._tenancies)}"
        for i in range(params.n):
            child = params
            engine_id = tenancy
            if params.n > 1:
                engine_id = f"{i}_{tenancy}"
                child = params.clone()
                child.n = 1
                if params.seed is not None:
                    child.seed = params.seed + i
            req = Request(engine_id, prompt_token_ids, child, self.eos_token_id,
                          arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                          block_size=self.config.cache.block_size, client_id=request_id)
            req.max_tokens = max_tokens
            req.grammar_waits_for = grammar_waits_for
            requests.append(req)
        return requests
