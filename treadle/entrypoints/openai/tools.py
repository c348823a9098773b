"""Tool calling in chat: what each tool_choice asks of the engine, and tool calls out of text.

  "none"      the tools go to the chat template; the answer is content.
  "auto"      the model decides; the --tool-call-parser finds calls in its text.
  "required"  a JSON-schema constraint: a list of one or more {"name", "parameters"} objects,
              each naming a given tool, with that tool's parameters schema.
  a function  a JSON-schema constraint on that function's parameters; the output is its arguments.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from treadle.entrypoints.openai.errors import OpenAIError
from treadle.entrypoints.openai.protocol import (ChatCompletionRequest, DeltaFunctionCall,
                                                  DeltaToolCall, FunctionCall, NamedToolChoice,
                                                  ToolCall)
from treadle.entrypoints.openai.tool_parsers.base import ParsedCall, ToolCallStream, ToolParser

_ANY_OBJECT = {"type": "object"}


def tool_choice_of(req: ChatCompletionRequest, parser: ToolParser | None) -> str | NamedToolChoice:
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise OpenAIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                                   "among the tools", "tool_choice")
    elif choice == "auto" and parser is None:
        raise OpenAIError(400, 'tool_choice "auto" needs the server started with '
                               "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
    return choice


def tool_constraint(req: ChatCompletionRequest, choice: str | NamedToolChoice) -> dict | None:
    """The structured_outputs a tool_choice needs, or None."""
    tools = req.tools or []
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return {"json": fn.parameters or _ANY_OBJECT}
    if choice != "required":
        return None
    # Each tool's parameters sit in the wrapper's $defs, their local $refs ("#", "#/$defs/..")
    # rebased there: nested in the wrapper as they are, they would resolve against it.
    defs = {f"tool_{i}": _rebased(t.function.parameters or _ANY_OBJECT, f"#/$defs/tool_{i}")
            for i, t in enumerate(tools)}
    items = [{"type": "object", "required": ["name", "parameters"], "properties": {
                 "name": {"type": "string", "enum": [t.function.name]},
                 "parameters": {"$ref": f"#/$defs/tool_{i}"}}}
             for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items},
                              "$defs": defs}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema}


def _rebased(schema: Any, prefix: str) -> Any:
    """`schema` with each local $ref ("#", "#/...") pointing under `prefix`. Values that are
    data, not schemas (const, enum, default, examples), are left as they are."""
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value
        elif key == "properties" and isinstance(value, dict):   # names are not keywords
            out[key] = {name: _rebased(sub, prefix) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, prefix)
    return out


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _required_items(text: str) -> tuple[list, str]:
    """The complete items of the JSON list `text` holds, and the text after the last of them
    that is not the list's end: "" for a whole list, the rest of one cut short."""
    decoder, start = json.JSONDecoder(), text.find("[")
    if start < 0:
        return [], text
    items, pos = [], start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\n\r,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(item)
    rest = "" if text[pos:].strip() == "]" else text[pos:]
    return items, rest if items or not rest else text


def _required_calls(items: list) -> list[ParsedCall]:
    return [ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


class ToolCalls:
    """Tool calls out of one choice's output under a tool_choice, whole or streamed."""

    def __init__(self, choice: str | NamedToolChoice, parser: ToolParser | None) -> None:
        self.choice = choice
        self.parser = parser
        self.stream: ToolCallStream | None = None
        self.num_streamed = 0   # tool calls sent so far; the next one's index
        self._text = ""         # required: the JSON list so far

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output, as `feed` streams them. A named function's
        call carries the text as its arguments, whole or not (as vLLM's); under "required",
        the list's complete items are calls, and the text after them, where an output cut
        short by max_tokens left it unparsed, is content."""
        if isinstance(self.choice, NamedToolChoice):
            return None, [tool_call(ParsedCall(self.choice.function.name, text))] if text else []
        if self.choice == "required":
            items, rest = _required_items(text)
            try:
                return rest or None, [tool_call(c) for c in _required_calls(items)]
            except (TypeError, KeyError):   # not the constraint's shape: left as text
                return text, []
        if self.choice == "auto":
            content, calls = self.parser.extract(text)
            return content, [tool_call(c) for c in calls]
        return text, []

    def feed(self, delta: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content, tool-call deltas) to stream for `delta` more text."""
        if isinstance(self.choice, NamedToolChoice):
            deltas = []
            # Announced with its first text: none comes while a thinking model reasons first.
            if self.num_streamed == 0 and delta:
                self.num_streamed = 1
                deltas.append(DeltaToolCall(index=0, id=_call_id(), type="function",
                                            function=DeltaFunctionCall(
                                                name=self.choice.function.name, arguments="")))
            if delta:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta)))
            return "", deltas
        if self.choice == "required":
            self._text += delta
            items, rest = _required_items(self._text)
            return rest if finished else "", self._deltas(_required_calls(items[self.num_streamed:]))
        if self.choice == "auto":
            self.stream = self.stream or self.parser.stream()
            content, calls = self.stream.feed(delta)
            if finished:
                rest, more = self.stream.finish()
                content, calls = content + rest, calls + more
            return content, self._deltas(calls)
        return delta, []

    def _deltas(self, calls: list[ParsedCall]) -> list[DeltaToolCall]:
        deltas = []
        for call in calls:
            deltas.append(DeltaToolCall(index=self.num_streamed, id=_call_id(), type="function",
                                        function=DeltaFunctionCall(name=call.name,
                                                                   arguments=call.arguments)))
            self.num_streamed += 1
        return deltas
