"""Reasoning parsers (`--reasoning-parser`, vLLM's flag): a thinking model's chain of thought,
apart from its answer, in the chat message's `reasoning` (and `reasoning_content`, the older
name many clients still read).

  deepseek_r1  DeepSeek-R1 and its distills, whose template opens <think> in the prompt.
  qwen3        Qwen3, QwQ and Qwen3.5 (whose templates put <think> in the prompt too, where the
               older ones let the model write it), with their switch: a request whose template
               variables say enable_thinking=false (its chat_template_kwargs, or the server's
               --default-chat-template-kwargs) gets an answer only.

The output is reasoning from its start (an opening <think> dropped) up to </think>, or to its
end if it never closes it (cut short while thinking); the answer after </think> is `content`,
and tool calls are looked for there only. Where thinking is off, or a grammar constrains the
reply (structured outputs, a forced tool call: it binds from the first token, so the model
cannot think first), only an output that opens with <think> has reasoning. The whole output
(`split`) and the streamed one (`ReasoningStream`) split alike, however the text is cut into
deltas: a tag cut between two deltas is held back until it is whole. Unlike vLLM's qwen3
parser, a <tool_call> does not end unclosed reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    # Whether the output starts inside the reasoning (its <think> is in the prompt).
    opens_inside: bool
    # Whether enable_thinking=false turns the reasoning off (qwen3's template switch).
    thinking_switch: bool = False

    def for_request(self, thinking: bool, constrained: bool) -> ReasoningParser:
        """The parser for one request: `thinking` is its enable_thinking (True if unset);
        `constrained`: a grammar binds its output from the first token."""
        inside = self.opens_inside and not constrained and (thinking or not self.thinking_switch)
        return ReasoningParser(inside, self.thinking_switch)

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
            "qwen3": ReasoningParser(opens_inside=True, thinking_switch=True)}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(reasoning_parser_names())}; "
                         f"got {name!r}")
    return _PARSERS[name]
