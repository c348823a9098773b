"""The grammar engines behind structured outputs, one interface for both.

A backend checks a constraint (cheaply, without the vocabulary), compiles it against the
model's tokenizer, and makes matchers: one per request, which track the tokens accepted so far
and fill that request's row of the token bitmask (bit t of a row set: token t is allowed).

The backends are found by name in registry.py, which imports them; this module imports none.
"""

from __future__ import annotations

import functools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import numpy as np
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


class StopIds:
    """A request's stop ids (its EOS, the model's other EOS ids, its stop_token_ids) as its
    grammar sees them: each one ends the output and is never text, so the mask allows them
    exactly where the grammar can end. Neither engine does this for every id by itself:
    llguidance ends only on the tokenizer's EOS, and xgrammar takes a stop id that is also text
    (xgrammar reads special tokens as their text) as that text where it completes the grammar,
    while the scheduler ends the request on it and drops its text. `refused`: the engine's own
    stop ids that are not the request's, never allowed."""

    def __init__(self, stop_ids: Iterable[int], refused: Iterable[int], vocab_size: int) -> None:
        self.ids = frozenset(t for t in stop_ids if 0 <= t < vocab_size)
        self.refused = frozenset(t for t in refused if 0 <= t < vocab_size) - self.ids
        self._keep, self._allow = _stop_rows(tuple(sorted(self.ids)), tuple(sorted(self.refused)),
                                             vocab_size)

    def apply(self, bitmask: torch.Tensor, row: int, can_end: bool) -> None:
        """Edit row `row` of a mask the engine filled: the stop ids allowed iff `can_end`."""
        masked = bitmask[row]   # a view: edited in place
        masked.bitwise_and_(self._keep)
        if can_end:
            masked.bitwise_or_(self._allow)


@functools.lru_cache(maxsize=64)
def _stop_rows(ids: tuple[int, ...], refused: tuple[int, ...], vocab_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, allow): bitmask rows with every token but `ids` and `refused`, and `ids` alone.
    Whole-row ANDs and ORs: two vector ops a row, however many stop ids."""
    def row(tokens: tuple[int, ...]) -> torch.Tensor:
        bits = np.zeros(((vocab_size + 31) // 32) * 32, dtype=bool)
        bits[list(tokens)] = True
        # Bit t % 32 of word t // 32, as both engines pack their masks.
        return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())
    allow = row(ids)
    return ~(allow | row(refused)), allow


class StopIdMatcher(Matcher):
    """A matcher whose stop ids are handled here, the same way for every engine (`StopIds`);
    the engine sees only the text tokens. A stop id is accepted where the grammar can end and
    terminates the matcher; the engine never consumes it, so a rollback past it undoes one
    token less there."""

    def __init__(self, stops: StopIds) -> None:
        self._stops = stops
        self._terminated = False

    @abstractmethod
    def _accept_text(self, token_id: int) -> bool:
        """The engine's accept of a token that is no stop id; False and no change if refused."""

    @abstractmethod
    def _rollback_text(self, num_tokens: int) -> None:
        """Undo the engine's last `num_tokens` tokens."""

    @abstractmethod
    def _fill_text(self, bitmask: torch.Tensor, row: int) -> None:
        """The engine's mask into row `row`; its bits for stop ids are overwritten after."""

    @abstractmethod
    def _can_end(self) -> bool:
        """Whether the grammar is complete here, so that a stop id may end the output."""

    def accept(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stops.ids:
            self._terminated = self._can_end()
            return self._terminated
        if token_id in self._stops.refused:
            return False
        return self._accept_text(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._rollback_text(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill_text(bitmask, row)
        self._stops.apply(bitmask, row, self._can_end())

    def is_terminated(self) -> bool:
        return self._terminated


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
