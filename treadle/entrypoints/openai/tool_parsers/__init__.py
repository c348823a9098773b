"""Tool-call parsers: each finds the tool calls in one model family's text, whole or streamed.

`--tool-call-parser NAME` picks one for `tool_choice="auto"`. A new format is a module here
with a `ToolParser` subclass (base.py), named in `_PARSERS`: imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.registry import lookup

if TYPE_CHECKING:
    from treadle.entrypoints.openai.tool_parsers.base import ToolParser

# name -> "module:class"
_PARSERS: dict[str, str] = {
    "hermes": "treadle.entrypoints.openai.tool_parsers.hermes:HermesToolParser",
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    return lookup(_PARSERS, name, "tool call parser")()
