"""The reasoning parsers (entrypoints/openai/reasoning.py): a whole output and the same output
streamed in any cuts split into the same reasoning and answer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.entrypoints.openai.reasoning import get_reasoning_parser

CASES = {
    # text: (thinking: deepseek_r1, and qwen3 by default; thinking off or constrained)
    "<think>abc</think>def": (("abc", "def"), ("abc", "def")),
    "abc</think>def": (("abc", "def"), (None, "abc</think>def")),
    "<think>cut short": (("cut short", None), ("cut short", None)),
    "no tags": (("no tags", None), (None, "no tags")),
    "<think></think>\n\nanswer": ((None, "\n\nanswer"), (None, "\n\nanswer")),
    "a<think>b</think>c": (("a<think>b", "c"), (None, "a<think>b</think>c")),
    "": ((None, None), (None, None)),
}
# A <tool_call> ends qwen3's unclosed reasoning and is content; deepseek_r1 thinks on through it.
TOOL_CALL_CASES = {   # text: (qwen3, deepseek_r1), both thinking
    "let me call<tool_call>{}</tool_call>": (("let me call", "<tool_call>{}</tool_call>"),
                                             ("let me call<tool_call>{}</tool_call>", None)),
    "<think>a<tool_call>b</think>c": (("a", "<tool_call>b</think>c"), ("a<tool_call>b", "c")),
    "a</think>b<tool_call>c": (("a", "b<tool_call>c"), ("a", "b<tool_call>c")),
    "<tool_call>x": ((None, "<tool_call>x"), ("<tool_call>x", None)),
}
DEEPSEEK, QWEN3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
# (parser, whether it thinks) for each way a request may come
RULES = {
    "deepseek_r1": (DEEPSEEK.for_request(thinking=True, constrained=False), True),
    "deepseek_r1 told not to think": (DEEPSEEK.for_request(thinking=False, constrained=False), True),
    "deepseek_r1 under a grammar": (DEEPSEEK.for_request(thinking=True, constrained=True), False),
    "qwen3": (QWEN3.for_request(thinking=True, constrained=False), True),
    "qwen3 enable_thinking=false": (QWEN3.for_request(thinking=False, constrained=False), False),
    "qwen3 under a grammar": (QWEN3.for_request(thinking=True, constrained=True), False),
}


@pytest.mark.parametrize("text", list(CASES))
def test_whole_outputs(text):
    for rule, (parser, thinks) in RULES.items():
        assert parser.split(text) == CASES[text][0 if thinks else 1], rule


@pytest.mark.parametrize("text", list(TOOL_CALL_CASES))
def test_a_tool_call_ends_qwen3s_reasoning(text):
    assert RULES["qwen3"][0].split(text) == TOOL_CALL_CASES[text][0]
    assert RULES["deepseek_r1"][0].split(text) == TOOL_CALL_CASES[text][1]


def streamed(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = parser.stream()
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<", "<th", "ink>", "</", "think>", "<think>", "</think>",
                                 "a", "b c", "\n", "think", ">", "<tool_", "call>", "<tool_call>"]),
                max_size=12),
       st.lists(st.integers(0, 60), max_size=6))
def test_streamed_in_any_cuts_equals_whole(words, cuts):
    text = "".join(words)
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for rule, (parser, _) in RULES.items():
        assert streamed(parser, pieces) == parser.split(text), (rule, pieces)


def test_an_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="reasoning parser must be one of deepseek_r1, qwen3; got 'r1'"):
        get_reasoning_parser("r1")
