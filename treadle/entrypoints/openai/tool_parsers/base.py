"""The tool-call parsers' common interface (the parsers by name: __init__.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str   # JSON text

    def __post_init__(self) -> None:
        # Parsed from the model's JSON, a string may hold half a surrogate pair (the model
        # wrote "\ud800"), which no response can carry: back to the escape it was written as.
        self.name, self.arguments = valid_unicode(self.name), valid_unicode(self.arguments)


def valid_unicode(text: str) -> str:
    """`text`, with any lone surrogate written as its escape (`\\ud800`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


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
