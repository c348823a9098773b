"""Incremental detokenization with stop strings.

Text is decoded over a small window of ids (the prefix/read-offset method): new text is only
emitted once it no longer ends in U+FFFD, so a character split across tokens comes out whole,
and the window starts a few tokens back so a leading space decodes as it would in context.
"""

from __future__ import annotations

from treadle.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5   # prompt tokens kept in the first window
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []          # output ids only
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._text = ""
        self._sent = 0                          # chars already returned as deltas
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @property
    def output_text(self) -> str:
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens)

    def _append(self, token_id: int) -> None:
        self._window.append(token_id)
        prefix = self._decode(self._window[self._prefix_offset:self._read_offset])
        full = self._decode(self._window[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._window)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens; returns the stop string that matched, if any (then the request must end).

        `stop_terminated`: the last new token is EOS or a stop token, whose text is left out
        unless include_stop_str_in_output. Do not call again after a stop string matched.
        """
        self.token_ids.extend(new_token_ids)
        to_decode = new_token_ids
        if stop_terminated and new_token_ids and not self.params.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        before = len(self._text)
        for t in to_decode:
            self._append(t)
        if not self.params.stop or len(self._text) == before:
            return None
        return self._check_stop_strings(before)

    def _check_stop_strings(self, new_from: int) -> str | None:
        # A stop string may begin up to max_stop - 1 chars before the new text.
        search_from = max(0, new_from - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            pos = self._text.find(s, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self._text = self._text[:pos + len(s)] if self.params.include_stop_str_in_output else self._text[:pos]
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now; while running, the last max_stop - 1 chars are held back, since
        they might be the start of a stop string that will be cut."""
        end = len(self._text)
        if not finished and self._max_stop and not self.params.include_stop_str_in_output:
            end = max(0, end - (self._max_stop - 1))
        if not delta:
            return self._text[:end]
        end = max(end, self._sent)
        chunk = self._text[self._sent:end]
        self._sent = end
        return chunk
