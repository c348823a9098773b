"""xgrammar (the default): grammars compiled ahead into per-state token masks.

A request's stop ids are handled around it (backend.StopIdMatcher), as guidance's are: xgrammar
reads special tokens as their text and takes a stop id the grammar could read as text as that
text where it completes the grammar, which the output would then lack (the scheduler ends the
request on a stop id and drops its text)."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
import xgrammar as xgr

from treadle.structured_output.backend import (GrammarBackend, GrammarError, Matcher,
                                               StopIdMatcher, StopIds, choice_grammar,
                                               engine_message)
from treadle.structured_output.params import StructuredOutputsParams

# Threads a compile may use; the engine's own threads are busy stepping the model.
_COMPILE_THREADS = 2


def _source(params: StructuredOutputsParams) -> tuple[str, str]:
    """The request's grammar as (language, text): a JSON schema ("json"), a regex, or EBNF."""
    if params.kind == "json":
        return "json", json.dumps(params.json)
    if params.kind == "json_object":
        return "json", '{"type": "object"}'
    if params.kind == "regex":
        return "regex", params.regex
    return "ebnf", choice_grammar(params.choice) if params.kind == "choice" else params.grammar


@functools.lru_cache(maxsize=256)
def _validate(kind: str, language: str, text: str, any_whitespace: bool) -> None:
    """Parse the grammar, once per text: a request validates it as it comes, and again as
    the engine takes it (a deep JSON schema parses in seconds; an error is not cached)."""
    try:
        if language == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif language == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except RuntimeError as e:
        raise GrammarError(f"invalid structured_outputs.{kind}: {engine_message(e)}") from None


class XgrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_id)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size,
            stop_token_ids=[eos_token_id] if eos_token_id is not None else None)
        # Its cache is keyed by the grammar's text: the same schema compiles once.
        self.compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        _validate(params.kind, *_source(params), not params.disable_any_whitespace)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        # The compiler's text-keyed entry points, so that a repeat is a cache hit.
        language, text = _source(params)
        try:
            if language == "json":
                return self.compiler.compile_json_schema(
                    text, any_whitespace=not params.disable_any_whitespace)
            if language == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except RuntimeError as e:
            raise GrammarError(f"invalid structured_outputs.{params.kind}: {engine_message(e)}") from None

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> Matcher:
        # Its stop ids (the tokenizer's, without any) only fill its masks: StopIds rewrites their
        # bits, and no stop id reaches its accept_token.
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        return XgrammarMatcher(matcher, StopIds(matcher.stop_token_ids, (), self.vocab_size))


class XgrammarMatcher(StopIdMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, stops: StopIds) -> None:
        super().__init__(stops)
        self._m = matcher

    def _accept_text(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def _rollback_text(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def _fill_text(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def _can_end(self) -> bool:
        return self._m.is_completed()
