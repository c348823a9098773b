"""Tool-call parsers: each finds the tool calls in one model family's text, whole or streamed.

`--tool-call-parser NAME` picks one for `tool_choice="auto"`. A new format is a module here
with a `ToolParser` subclass registered under its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable


@dataclass
class ParsedCall:
    name: str
    arguments: str   # JSON text


class ToolCallStream(ABC):
    """Fed a choice's text as it grows; hands back what can be sent."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """(content to send, tool calls completed) after `delta` more text."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is left once the output has ended (text held back in case a call began)."""


class ToolParser(ABC):
    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole output: (content outside the calls, or None if there is none; the calls)."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one streamed choice."""


_PARSERS: dict[str, Callable[[], ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls
    return register


def tool_parser_names() -> list[str]:
    _load_builtin()
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    _load_builtin()
    if name not in _PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(sorted(_PARSERS))}; "
                         f"got {name!r}")
    return _PARSERS[name]()


def _load_builtin() -> None:
    from treadle.entrypoints.openai.tool_parsers import hermes  # noqa: F401 (registers)
