"""Reasoning parsers (`--reasoning-parser`, vLLM's flag): a thinking model's chain of thought,
apart from its answer, in the chat message's `reasoning` (and `reasoning_content`, the older
name many clients still read).

  deepseek_r1  DeepSeek-R1 and its distills, whose template opens <think> in the prompt: the
               output is reasoning from its start (an opening <think> dropped) up to </think>,
               or to its end if it never closes it (cut short while thinking).
  qwen3        Qwen3 and QwQ: reasoning only where the output opens with <think>, up to
               </think> or the end; any other output is all answer (enable_thinking=False).

The answer after </think> is `content`, and tool calls are looked for there only. The whole
output (`split`) and the streamed one (`ReasoningStream`) split alike, however the text is cut
into deltas: a tag cut between two deltas is held back until it is whole.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    # Whether the output starts inside the reasoning (its <think> is in the prompt).
    opens_inside: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content); None where a part is empty."""
        if text.startswith(START):
            text = text[len(START):]
        elif not self.opens_inside:
            return None, text or None
        reasoning, _, content = text.partition(END)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One streamed choice's text, fed as it grows: each feed returns the reasoning and the
    content to send."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.mode = "start"   # then "reasoning", then "content"
        self.held = ""        # text that may be the start of a tag

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.mode == "start":
            if START.startswith(text) and text != START and not finished:
                self.held = text   # perhaps <think>, not yet whole
                return "", ""
            if text.startswith(START):
                text, self.mode = text[len(START):], "reasoning"
            else:
                self.mode = "reasoning" if self.parser.opens_inside else "content"
        if self.mode == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = 0 if finished else _tag_prefix_at_end(text, END)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self.mode = text[:end], text[end + len(END):], "content"
        return reasoning, text


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_PARSERS = {"deepseek_r1": ReasoningParser(opens_inside=True),
            "qwen3": ReasoningParser(opens_inside=False)}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(reasoning_parser_names())}; "
                         f"got {name!r}")
    return _PARSERS[name]
