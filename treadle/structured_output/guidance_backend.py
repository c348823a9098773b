"""llguidance (`structured_outputs_config={"backend": "guidance"}`): masks computed lazily, per
step, from an Earley parser; nothing to compile ahead beyond checking the grammar."""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from treadle.structured_output.backend import GrammarBackend, GrammarError, Matcher
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
        # The tokenizer's EOS is the grammar's stop token; other stop ids are not grammar stops.
        return GuidanceMatcher(llguidance.LLMatcher(self.ll_tokenizer, compiled), self.eos_token_id)


class GuidanceMatcher(Matcher):
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int | None) -> None:
        self._m = matcher
        self._eos = eos_token_id
        # llguidance reports "stopped" as soon as only EOS can follow; terminated is after it.
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        # Checked first: a refused token would leave the matcher in its error state. Its check
        # of tokens never counts EOS, which is allowed exactly where the grammar can end.
        if self._terminated:
            return False
        allowed = (self._m.is_accepting() if token_id == self._eos
                   else self._m.validate_tokens([token_id]) == 1)
        if not allowed:
            return False
        self._m.consume_token(token_id)
        self._terminated = token_id == self._eos
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_error():
            # No way on (an unsatisfiable regex): llguidance would allow EOS alone, which accept()
            # refuses as the grammar cannot end here. An empty row says what it is.
            bitmask[row].zero_()
            return
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

