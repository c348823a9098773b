"""The tool-call parsers' common interface (the parsers by name: __init__.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


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
