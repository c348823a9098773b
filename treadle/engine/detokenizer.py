"""Incremental detokenization with stop strings.

Text is decoded over a small window of ids (the prefix/read-offset method): `_prefix_offset`
is where the window starts, `_read_offset` where the text already emitted ends. Each new token
decodes the window twice, without and with the unread ids, and the difference is the new text.
It is only emitted once it no longer ends in U+FFFD, so a character whose bytes are split over
several tokens comes out whole. The first window starts with a few prompt tokens, so that
tokenizers whose decoder strips a leading space at the start (SentencePiece) decode the first
output token as they would in context.

The concatenated text equals `tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)` for byte-level BPE tokenizers, including text left pending
at the end (a last token that is half a character), which is flushed when the request finishes.
"""

from __future__ import annotations

import logging
from typing import Callable

from treadle.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_PROMPT_CONTEXT = 5   # prompt tokens that seed the first window
_REPLACEMENT = "\ufffd"


def rust_decode(tokenizer) -> Callable[..., str] | None:
    """The Rust tokenizer's own decode, where transformers' decode without clean-up would only
    call it: a fast tokenizer whose class keeps the base `_decode` (fast tokenizers ignore
    spaces_between_special_tokens). It costs a third of the wrapper's time per call (3.0 against
    10.4 us, SmolLM2's tokenizer on a Zen 3), and a step pays two calls per request."""
    # Imported here: `import treadle` does not import transformers (a second or more).
    from transformers import PreTrainedTokenizerFast

    if getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer._tokenizer.decode


class IncrementalDetokenizer:
    """Detokenizes one sample's output ids as they arrive and finds its stop strings.

    Call `update` with each step's new ids; after it returns a stop string the sample is over
    and `update` must not be called again (it raises RuntimeError). `get_next_output_text`
    gives the text a client may see now.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._rust_decode = rust_decode(tokenizer)
        self.token_ids: list[int] = []      # output ids only, stop/EOS token included
        self._stop = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._window = self._prompt_context(prompt_token_ids)
        # Text only at the end (a final-only output with no stop strings to look for): the ids
        # wait in the window and the end decodes them at once, where each step decoded twice.
        # The text is the same as step by step (`_text_at_end`).
        self._at_end = params.output_kind == RequestOutputKind.FINAL_ONLY and not self._stop
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._text = ""
        self._num_sent = 0                  # chars already returned by delta calls
        self._stop_matched: str | None = None
        self._flushed = False

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # A prompt that ends half-way through a character would swallow the bytes that complete
        # it into text we never emit; start from nothing instead (matches decoding the output).
        if context and self._decode(context).endswith(_REPLACEMENT):
            return []
        return context

    @property
    def output_text(self) -> str:
        """All text so far (after any stop-string truncation), not counting pending text (a
        final-only output with no stop strings holds all of it pending until it finishes)."""
        return self._text

    @property
    def stop_string_matched(self) -> str | None:
        return self._stop_matched

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it rewrites text across token boundaries (" n't" -> "n't"), so
        # a window's text would stop being a prefix of the next window's.
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False)

    def _new_text(self, force: bool) -> str:
        """Text of the unread ids; '' while it ends in a half character, unless `force`."""
        if self._read_offset == len(self._window):
            return ""
        prefix = self._decode(self._window[self._prefix_offset:self._read_offset])
        full = self._decode(self._window[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not force):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window)
        return full[len(prefix):]

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add one step's ids; returns the stop string that matched, if any.

        Ids are taken one at a time, exactly as if each had come in a step of its own, so a
        step of 1 + k tokens (speculative decoding) gives the same output as k + 1 steps: when
        a stop string completes, the ids after the one that completed it are dropped.
        `stop_terminated`: the last new id is EOS or a stop token id; its text is left out of
        the output unless include_stop_str_in_output. After a stop string matched the sample
        must end: calling update again raises RuntimeError.
        """
        if self._stop_matched is not None:
            raise RuntimeError(f"update() after stop string {self._stop_matched!r} ended the output")
        if self._at_end:
            self.token_ids += new_token_ids
            drop_last = stop_terminated and not self.params.include_stop_str_in_output
            self._window += new_token_ids[:-1] if drop_last else new_token_ids
            return None
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            if i == last and stop_terminated and not self.params.include_stop_str_in_output:
                break
            start = len(self._text)
            self._window.append(token_id)
            self._text += self._new_text(force=False)
            if self._check_stop_strings(start) is not None:
                break
        return self._stop_matched

    def _check_stop_strings(self, start: int) -> str | None:
        """Finds the first stop string that ends in the text from `start` on."""
        if not self._stop or len(self._text) == start:
            return None
        # As in vLLM, stop strings only count once min_tokens tokens have been generated.
        if len(self.token_ids) <= self.params.min_tokens:
            return None
        best: tuple[int, str] | None = None
        for s in self._stop:
            # From where a match of `s` would end in the new text, never wholly in older text
            # (which min_tokens may have kept from matching).
            pos = self._text.find(s, max(0, start - len(s) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        end = pos + len(s) if self.params.include_stop_str_in_output else pos
        self._text = self._text[:end]
        self._stop_matched = s
        return s

    def _text_at_end(self) -> str:
        """The text of the ids held for the end: one decode, unless it holds U+FFFD. A
        ByteFallback decoder (SentencePiece models: Llama 2, Mistral, Gemma, Phi-3) turns a
        whole invalid run of byte tokens into U+FFFD, characters that came out whole in the
        step-by-step windows included; then the ids go through those windows, as they would
        have step by step."""
        prefix, read = self._prefix_offset, self._read_offset
        text = self._new_text(force=True)
        if _REPLACEMENT not in text:
            return text
        pending = self._window[read:]
        self._window, self._prefix_offset, self._read_offset = self._window[:read], prefix, read
        pieces = []
        for token_id in pending:
            self._window.append(token_id)
            pieces.append(self._new_text(force=False))
        pieces.append(self._new_text(force=True))
        return "".join(pieces)

    def _flush(self) -> None:
        """At the end, emit text still held for a half character (as U+FFFD, like decode)."""
        if self._flushed:
            return
        self._flushed = True
        if self._stop_matched is not None:
            return
        start = len(self._text)
        self._text += self._text_at_end() if self._at_end else self._new_text(force=True)
        # The request is already ending, so a match here can only trim the text.
        if self._check_stop_strings(start) is not None:
            logger.debug("stop string %r found in the text flushed at the end", self._stop_matched)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it, or with `delta` only what no delta call returned.

        While running with stop strings that are cut from the output, the last
        max_stop_len - 1 chars are held back: they might begin a stop string that is later
        cut, and a client must never see text that disappears.
        """
        if finished:
            self._flush()
        end = len(self._text)
        if not finished and self._max_stop_len and not self.params.include_stop_str_in_output:
            end = max(0, end - (self._max_stop_len - 1))
        if not delta:
            return self._text[:end]
        # A cut never goes below what was sent (a match must end in unsearched text), so
        # max() only guards against an end shrunk by the hold-back.
        end = max(end, self._num_sent)
        chunk = self._text[self._num_sent:end]
        self._num_sent = end
        return chunk
