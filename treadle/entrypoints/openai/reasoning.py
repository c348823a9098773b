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
and tool calls are looked for there only. A grammar (structured outputs, a forced tool call)
binds after the reasoning too (structured_output/reasoning.py), unless the prompt has ended it
or the engine applies grammars in the reasoning; where thinking is off, or a grammar binds from
the first token, only an output that opens with <think> has reasoning. The whole output
(`split`) and the streamed one (`ReasoningStream`) split alike, however the text is cut into
deltas: a tag cut between two deltas is held back until it is whole. With qwen3, as with
vLLM's, a <tool_call> ends the reasoning too (Qwen3.5 may call a tool without closing its
thought); the call is content, where the tool parser finds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from treadle.structured_output.reasoning import (REASONING_TAGS, check_reasoning_parser,
                                                 reasoning_parser_names)

START, END = REASONING_TAGS["qwen3"]   # both parsers' tags
TOOL_CALL = "<tool_call>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str   # its tags' (structured_output/reasoning.py)
    # Whether the output starts inside the reasoning (its <think> is in the prompt).
    opens_inside: bool
    # Whether enable_thinking=false turns the reasoning off (qwen3's template switch).
    thinking_switch: bool = False
    # Whether a <tool_call> ends the reasoning (and begins the content).
    tool_call_ends: bool = False

    def for_request(self, thinking: bool, constrained: bool) -> ReasoningParser:
        """The parser for one request: `thinking` is its enable_thinking (True if unset);
        `constrained`: a grammar binds its output from the first token (not after the
        reasoning)."""
        inside = self.opens_inside and not constrained and (thinking or not self.thinking_switch)
        return dataclasses.replace(self, opens_inside=inside)

    def end_of_reasoning(self, text: str) -> tuple[int, int]:
        """Where the reasoning in `text` ends, and where the content begins (-1, -1: not in it)."""
        end = text.find(END)
        call = text.find(TOOL_CALL) if self.tool_call_ends else -1
        if call >= 0 and (end < 0 or call < end):
            return call, call
        return (end, end + len(END)) if end >= 0 else (-1, -1)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content); None where a part is empty."""
        if text.startswith(START):
            text = text[len(START):]
        elif not self.opens_inside:
            return None, text or None
        end, content = self.end_of_reasoning(text)
        if end < 0:
            return text or None, None
        return text[:end] or None, text[content:] or None

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
            end, content = self.parser.end_of_reasoning(text)
            if end < 0:
                tags = (END, TOOL_CALL) if self.parser.tool_call_ends else (END,)
                keep = 0 if finished else max(_tag_prefix_at_end(text, tag) for tag in tags)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self.mode = text[:end], text[content:], "content"
        return reasoning, text


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", opens_inside=True),
            "qwen3": ReasoningParser("qwen3", opens_inside=True, thinking_switch=True,
                                     tool_call_ends=True)}
assert set(_PARSERS) == set(reasoning_parser_names())


def get_reasoning_parser(name: str) -> ReasoningParser:
    check_reasoning_parser(name)
    return _PARSERS[name]
