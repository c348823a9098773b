"""llguidance (`structured_outputs_config={"backend": "guidance"}`): masks computed lazily, per
step, from an Earley parser; nothing to compile ahead beyond checking the grammar.

Its tokenizer knows one EOS, shared by every request, so a request's stop ids (the model's other
EOS ids, its stop_token_ids) are handled around it (backend.StopIdMatcher), as xgrammar's are:
allowed and accepted where the grammar can end, ending the output, and nowhere else."""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from treadle.structured_output.backend import (GrammarBackend, GrammarError, Matcher, StopIdMatcher,
                                               StopIds)
from treadle.structured_output.params import StructuredOutputsParams


def _grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            return llguidance.grammar_from("json_schema", json.dumps(
                {**schema, "x-guidance": options} if isinstance(schema, dict) else schema))
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:   # a grammar it could not even convert
        raise GrammarError(f"invalid structured_outputs.{kind}: {e}") from None


@functools.lru_cache(maxsize=256)
def _checked(key: tuple, grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid structured_outputs.{key[0]}: {error}")
    return grammar


class GuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_id)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=eos_token_id)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        _checked(params.key, _grammar(params))

    def compile(self, params: StructuredOutputsParams) -> str:
        return _checked(params.key, _grammar(params))

    def matcher(self, compiled: str, stop_token_ids: list[int]) -> Matcher:
        # No stop ids: the tokenizer's EOS alone, as llguidance itself would have it.
        stop_ids = stop_token_ids or ([self.eos_token_id] if self.eos_token_id is not None else [])
        own = getattr(self.ll_tokenizer, "eos_tokens", None) or [self.ll_tokenizer.eos_token]
        own = [t for t in own if t is not None]
        return GuidanceMatcher(llguidance.LLMatcher(self.ll_tokenizer, compiled),
                               StopIds(stop_ids, own, self.vocab_size))


class GuidanceMatcher(StopIdMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, stops: StopIds) -> None:
        super().__init__(stops)
        self._m = matcher

    def _accept_text(self, token_id: int) -> bool:
        # Checked first: a refused token would leave the matcher in its error state.
        if self._m.validate_tokens([token_id]) != 1:
            return False
        self._m.consume_token(token_id)
        return True

    def _rollback_text(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def _fill_text(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_error():
            # No way on (an unsatisfiable regex): llguidance would allow EOS alone, which the
            # grammar cannot end with here. An empty row says what it is.
            bitmask[row].zero_()
            return
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def _can_end(self) -> bool:
        # Where llguidance would allow its EOS ("stopped" too: only EOS may follow).
        return not self._m.is_error() and self._m.is_accepting()
