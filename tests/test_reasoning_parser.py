"""The reasoning parsers (entrypoints/openai/reasoning.py): a whole output and the same output
streamed in any cuts split into the same reasoning and answer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.entrypoints.openai.reasoning import get_reasoning_parser, reasoning_parser_names

CASES = {
    # text: (deepseek_r1, qwen3)
    "<think>abc</think>def": (("abc", "def"), ("abc", "def")),
    "abc</think>def": (("abc", "def"), (None, "abc</think>def")),
    "<think>cut short": (("cut short", None), ("cut short", None)),
    "no tags": (("no tags", None), (None, "no tags")),
    "<think></think>\n\nanswer": ((None, "\n\nanswer"), (None, "\n\nanswer")),
    "a<think>b</think>c": (("a<think>b", "c"), (None, "a<think>b</think>c")),
    "": ((None, None), (None, None)),
}


@pytest.mark.parametrize("text", list(CASES))
def test_whole_outputs(text):
    for name, want in zip(("deepseek_r1", "qwen3"), CASES[text]):
        assert get_reasoning_parser(name).split(text) == want, name


def streamed(name: str, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = get_reasoning_parser(name).stream()
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<", "<th", "ink>", "</", "think>", "<think>", "</think>",
                                 "a", "b c", "\n", "think", ">"]), max_size=12),
       st.lists(st.integers(0, 60), max_size=6))
def test_streamed_in_any_cuts_equals_whole(words, cuts):
    text = "".join(words)
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for name in reasoning_parser_names():
        assert streamed(name, pieces) == get_reasoning_parser(name).split(text), (name, pieces)


def test_an_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="reasoning parser must be one of deepseek_r1, qwen3; got 'r1'"):
        get_reasoning_parser("r1")
