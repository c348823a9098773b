"""The grammar engines behind structured outputs, one interface for both.

A backend checks a constraint (cheaply, without the vocabulary), compiles it against the
model's tokenizer, and makes matchers: one per request, which track the tokens accepted so far
and fill that request's row of the token bitmask (bit t of a row set: token t is allowed).

The backends are found by name in registry.py, which imports them; this module imports none.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

import torch

from treadle.structured_output.params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint the grammar engine refused; the message is the engine's."""


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether a stop token was accepted: nothing may follow."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here; changes nothing."""
        n = 0
        for t in token_ids:
            if not self.accept(t):
                break
            n += 1
        if n:
            self.rollback(n)
        return n


class GrammarBackend(ABC):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise GrammarError if the engine cannot take the constraint; no tokenizer needed."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The constraint compiled for this tokenizer (cached); raises GrammarError."""

    @abstractmethod
    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Matcher:
        """A matcher at the grammar's start; `stop_token_ids` end the output where it can end."""

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 bitmask with every token allowed."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def engine_message(error: Exception) -> str:
    """The grammar engine's message without its C++ time stamp and source location."""
    return _LOCATION.sub("", str(error)).strip()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose output is exactly one of `choices`."""
    # JSON string literals are valid EBNF literals: quotes, backslashes and controls escaped.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
