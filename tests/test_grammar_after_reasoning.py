"""Structured outputs after the reasoning: with a reasoning parser, a grammar binds once the
output has written </think> (structured_output/reasoning.py), held to transformers' greedy
`generate` under a processor that applies xgrammar's own mask from the token after </think>,
under each scheduling feature that moves tokens around the sampler.

SmolLM2 does not think, but shown one exchange that thinks in <think></think> tags and a prompt
that opens the next, it writes a short thought, </think> (three tokens in its vocabulary, so
the end is matched across steps and drafts) and an answer, which the grammar then shapes.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle import LLM, SamplingParams, StructuredOutputsParams
from treadle.models.loader import load_tokenizer, prepare_model
from treadle.structured_output.reasoning import (AfterReasoning, prompt_opens_reasoning,
                                                 reasoning_end_token_ids)
from treadle.structured_output.registry import get_backend

from tests.deferred import defer_and_record, num_deferred, record_waits

ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
CONSTRAINT = StructuredOutputsParams(json=ANSWER)
QUESTIONS = ["What is 2+3? Think, then answer as JSON.",
             "Is the sky green? Think first, then answer yes or no.",
             "Name a colour of the sky. Think step by step."]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model_path(smollm2_path) -> str:
    return prepare_model(smollm2_path)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def cases(tokenizer) -> list[tuple[str, dict | None, bool]]:
    """(prompt, extra_args, whether the grammar waits for the reasoning to end)."""
    cases = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": "What is 1+1? Think inside <think></think> tags, "
                                                "then answer."},
                    {"role": "assistant", "content": "<think>1 plus 1 makes 2.</think>The answer is 2."},
                    {"role": "user", "content": q}]
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cases.append((chat + "<think>", None, True))   # the prompt opens the reasoning
    chat = cases[0][0].removesuffix("<think>")
    return cases + [
        (chat + "<think>Easy.</think>", None, False),   # the prompt has ended it
        (chat, None, False),   # its last tag (the example's) closes the reasoning
        # The request says the output starts inside it (as the chat server does from a
        # template's thinking switch): the model opens <think> itself and the grammar waits.
        (chat, {"reasoning": True}, True),
        ("A JSON object:", None, False),   # no tag: a raw prompt was not asked to think
    ]


class AfterEnd(transformers.LogitsProcessor):
    """Leaves the logits alone until the output holds `end`, then hands them to `inner`."""

    def __init__(self, inner: transformers.LogitsProcessor, end: list[int], prompt_len: int) -> None:
        self.inner, self.end, self.prompt_len = inner, end, prompt_len

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:].tolist()
        n = len(self.end)
        if not any(out[i:i + n] == self.end for i in range(len(out) - n + 1)):
            return scores
        return self.inner(input_ids, scores)   # its first call takes all before as the prompt


@functools.lru_cache(maxsize=None)
def _hf_reference(hf_model, model_path: str, prompt: tuple[int, ...], waits: bool) -> list[int]:
    tokenizer = load_tokenizer(model_path)
    compiled = get_backend("xgrammar", model_path, hf_model.config.vocab_size).compile(CONSTRAINT)
    processor = xgr.contrib.hf.LogitsProcessor(compiled)
    if waits:
        processor = AfterEnd(processor, list(reasoning_end_token_ids(tokenizer, "deepseek_r1")),
                             len(prompt))
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=MAX_TOKENS, logits_processor=[processor],
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


SETTINGS = [
    ("batched", {}),
    ("chunked_prefill", {"max_num_batched_tokens": 16}),
    ("preemption", {"num_kv_blocks": 12, "max_model_len": 160}),
    ("async_scheduling_deferred", {"async_scheduling": True}),
    # Drafts stop short of the draft that would end the reasoning: the row after it is masked.
    ("ngram_speculation", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}}),
    # The grammar may also bind from the first token, as vLLM's enable_in_reasoning.
    ("enable_in_reasoning", {"structured_outputs_config": {"enable_in_reasoning": True}}),
]


@pytest.mark.parametrize("name,engine_args", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_the_grammar_binds_after_the_reasoning(name, engine_args, model_path, tokenizer, cases,
                                               reference, monkeypatch):
    hf_model = reference(model_path).model
    in_reasoning = name == "enable_in_reasoning"
    if name == "async_scheduling_deferred":
        # The thinking prompts alone, so that steps run with only waiting grammars, one of them
        # ending its reasoning with a token still on the device (grammars that bind at once are
        # deferred in test_structured_outputs.py).
        cases = [case for case in cases if case[2]]
    with LLM(model_path, reasoning_parser="deepseek_r1",
             **{"max_model_len": 512, "block_size": 16, "num_kv_blocks": 64, **engine_args}) as llm:
        deferred = defer_and_record(llm) if name == "async_scheduling_deferred" else []
        step_waits = record_waits(llm, monkeypatch) if name == "async_scheduling_deferred" else []
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINT,
                                 extra_args=extra) for _, extra, _ in cases]
        outs = llm.generate([prompt for prompt, _, _ in cases], params, use_tqdm=False)
        stats = llm.engine.core.get_stats()
    end, thoughts = "</think>", 0
    for (prompt, _, waits), out in zip(cases, outs):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        want = _hf_reference(hf_model, model_path, tuple(ids), waits and not in_reasoning)
        text = out.outputs[0].text
        assert list(out.outputs[0].token_ids) == want, (name, prompt[-40:], text)
        # The proof that the grammar waited, then bound: a thought, then JSON (or a thought
        # that never ended: the request that said it starts inside the reasoning).
        if waits and not in_reasoning:
            assert not text.startswith("{") and text.partition(end)[2].startswith("{" if end in text else ""), text
            thoughts += end in text
        else:
            assert text.startswith("{") and end not in text, text
    assert in_reasoning or thoughts == len(QUESTIONS)
    if name == "preemption":
        assert stats.num_preemptions > 0
    elif name == "ngram_speculation":
        assert stats.spec_decoding.num_draft_tokens > 0
    elif name == "async_scheduling_deferred":
        assert num_deferred(deferred) > 30
        # Deferred steps wait for the step before only for a matcher's sake: a row after a token
        # still on the device that may end the reasoning takes the grammar's first mask there,
        # where that token ends it (the JSON right after </think> above is the proof).
        assert all(waited == ("matcher" in kinds) for waited, kinds in step_waits), step_waits
        assert any(kinds == {"waiting"} for _, kinds in step_waits), step_waits
        assert any(waited for waited, _ in step_waits)


def test_where_the_prompt_leaves_the_reasoning():
    assert prompt_opens_reasoning("Hello <think>", "qwen3") is True
    assert prompt_opens_reasoning("<think>\n\n</think>\n\n", "qwen3") is False
    assert prompt_opens_reasoning("<think>a</think> then <think>", "deepseek_r1") is True
    assert prompt_opens_reasoning("no tags at all", "deepseek_r1") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.data())
def test_the_end_is_found_however_the_output_is_cut(tokens, data):
    """Fed in pieces (steps, accepted drafts), the end is found at the token that completes it,
    and only there."""
    end = (1, 2, 3)
    want = next((i + 2 for i in range(len(tokens) - 2) if tuple(tokens[i:i + 3]) == end), None)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(tokens) - 1)), max_size=6)))
    waiting = AfterReasoning(matcher=None, end=end)
    done, found = 0, None
    for piece in _pieces(tokens, cuts):
        if (at := waiting.feed(piece)) is not None:
            found = done + at
            break
        done += len(piece)
    assert found == want


def _pieces(tokens: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *[c for c in cuts if c < len(tokens)], len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:])]


def test_an_unknown_reasoning_parser_is_refused(model_path):
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3; got 'r2'"):
        LLM(model_path, reasoning_parser="r2")
    with pytest.raises(ValueError, match="structured_outputs_config.reasoning_parser must be one of"):
        LLM(model_path, structured_outputs_config={"reasoning_parser": "r1"})
    with pytest.raises(ValueError, match="reasoning_parser is 'qwen3' but "
                                         "structured_outputs_config.reasoning_parser is 'deepseek_r1'"):
        LLM(model_path, reasoning_parser="qwen3",
            structured_outputs_config={"reasoning_parser": "deepseek_r1"})
    with pytest.raises(ValueError, match="enable_in_reasoning must be true or false"):
        LLM(model_path, structured_outputs_config={"enable_in_reasoning": "yes"})


def test_a_bad_reasoning_extra_arg_is_refused(model_path):
    with LLM(model_path, max_model_len=128, num_kv_blocks=16, block_size=16) as llm:
        with pytest.raises(ValueError, match=r"extra_args\['reasoning'\] must be true or false"):
            llm.generate("Hi", SamplingParams(max_tokens=1, extra_args={"reasoning": "yes"}))
