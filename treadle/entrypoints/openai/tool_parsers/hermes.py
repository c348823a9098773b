"""The JSON-in-tags format of Hermes, Qwen2.5/3 and many fine-tunes:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose JSON does not parse, or lacks a name, stays in the content: nothing is dropped.
"""

from __future__ import annotations

import json
import re

from treadle.entrypoints.openai.tool_parsers.base import (ParsedCall, ToolCallStream, ToolParser,
                                                         valid_unicode)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def _call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if valid_unicode(obj["name"]) != obj["name"]:   # no tool's name: left in the content
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls, content, last = [], [], 0
        for m in _BLOCK.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue   # left in the content
            calls.append(call)
            content.append(text[last:m.start()])
            last = m.end()
        content.append(text[last:])
        joined = "".join(content)
        return (joined.strip() or None) if calls else text, calls

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(ToolCallStream):
    def __init__(self) -> None:
        self.buffer = ""   # text not handed out yet: a tag begun, or a block not closed

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += delta
        content, calls = [], []
        while self.buffer:
            start = self.buffer.find(START)
            if start < 0:
                keep = _partial_tag_len(self.buffer)   # "<tool_c" may be a tag's start
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content.append(self.buffer[:start])
            end = self.buffer.find(END, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            block = self.buffer[start:end + len(END)]
            call = _call(block[len(START):-len(END)])
            if call is None:
                content.append(block)
            else:
                calls.append(call)
            self.buffer = self.buffer[end + len(END):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        return rest, []


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of `text` that begins START."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
