"""Structured outputs after the reasoning: with a reasoning parser (vLLM's `reasoning_parser`,
which `--reasoning-parser` sets too), a thinking model's grammar binds only once its chain of
thought has ended, so that it can think first and answer in the grammar after.

A constrained request's grammar waits for the end tag's tokens in its output where the output
starts inside the reasoning: where the request says so (`extra_args["reasoning"]`, which the
chat server sets from the template's thinking switch and the prompt), or else where the prompt's
last tag opens the reasoning (DeepSeek-R1's and Qwen3.5's templates end the prompt with <think>).
A prompt whose last tag closes it (Qwen3's template with enable_thinking=false writes an empty
<think></think>), or a raw prompt with no tag, binds from the first token: a model that was not
asked to think never leaves its grammar asleep. With `enable_in_reasoning` the grammar binds
from the first token, reasoning or not. The output side is matched on token ids
(worker/grammar.py): exact for the models these parsers are for, whose tags are single tokens;
a model that spells the end tag in other tokens keeps thinking.
"""

from __future__ import annotations

import torch

from treadle.structured_output.backend import Matcher

# Each parser's (start tag, end tag).
REASONING_TAGS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
}


def reasoning_parser_names() -> list[str]:
    return sorted(REASONING_TAGS)


def check_reasoning_parser(name: str, field: str = "reasoning parser") -> None:
    if not isinstance(name, str) or name not in REASONING_TAGS:
        raise ValueError(f"{field} must be one of {', '.join(reasoning_parser_names())}; "
                         f"got {name!r}")


def prompt_opens_reasoning(prompt: str, parser: str) -> bool | None:
    """Whether the prompt leaves its output inside the reasoning: True where its last tag opens
    it, False where its last tag closes it, None where it has neither tag."""
    start, end = REASONING_TAGS[parser]
    last_start, last_end = prompt.rfind(start), prompt.rfind(end)
    if last_start < 0 and last_end < 0:
        return None
    return last_start > last_end


def reasoning_end_token_ids(tokenizer, parser: str) -> tuple[int, ...]:
    """The tokens of the parser's end tag, as the model writes it."""
    ids = tuple(tokenizer.encode(REASONING_TAGS[parser][1], add_special_tokens=False))
    if not ids:
        raise ValueError(f"reasoning parser {parser!r}: the tokenizer has no tokens for its end "
                         f"tag {REASONING_TAGS[parser][1]!r}")
    return ids


class AfterReasoning:
    """A slot's grammar before its output has ended the reasoning with the `end` tokens."""

    def __init__(self, matcher: Matcher, end: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.end = end
        self.recent: list[int] = []   # the output's last len(end) - 1 tokens: a tag's start
        # The grammar's first mask, once worker/grammar.py has filled it: a single-token tag
        # may end the reasoning at any step, and the mask is the same each time.
        self.first_mask: torch.Tensor | None = None

    def completed_at(self, tokens: list[int]) -> int | None:
        """The index of the token of `tokens` (following what was fed) that completes the end."""
        seen = self.recent + tokens
        n = len(self.end)
        for i in range(max(len(self.recent), n - 1), len(seen)):
            if tuple(seen[i + 1 - n:i + 1]) == self.end:
                return i - len(self.recent)
        return None

    def token_that_ends(self) -> int | None:
        """The token that ends the reasoning if the output's next token is it; None where no one
        token can (the output does not end with the rest of the end tag)."""
        rest = self.end[:-1]
        return self.end[-1] if tuple(self.recent[len(self.recent) - len(rest):]) == rest else None

    def feed(self, tokens: list[int]) -> int | None:
        """Take the output's next tokens: the index of the one that ends the reasoning, if any."""
        at = self.completed_at(tokens)
        if at is None and len(self.end) > 1:
            self.recent = (self.recent + tokens)[-(len(self.end) - 1):]
        return at
