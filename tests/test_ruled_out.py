"""A request whose own constraints leave no token to sample (allowed_token_ids outside its
grammar, only stop tokens allowed before min_tokens, bad_words banning the last allowed token)
ends with finish_reason "error" and the reason, at the token where it ran out, with the output
before it kept; vLLM samples token 0 there, and a sampled row would draw from NaN probabilities.
Its neighbours in the batch are untouched: held to transformers. Waited, deferred (the check
comes down with the tokens, in the step's one wait) and with n-gram drafts."""

from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams, StructuredOutputsParams
from treadle.models.loader import load_tokenizer, prepare_model

from tests.deferred import defer_and_record, num_deferred

PROMPT = "The cat sat on the mat. The cat sat on the"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_path(smollm2_path) -> str:
    return prepare_model(smollm2_path)


SETTINGS = [
    ("waited", {}),
    ("deferred", {"async_scheduling": True}),
    ("ngram_speculation", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}}),
]


@pytest.mark.parametrize("name,engine_args", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_a_request_with_no_token_left_ends_with_the_reason(name, engine_args, model_path, reference):
    tokenizer = load_tokenizer(model_path)
    the = tokenizer.encode(" the", add_special_tokens=False)
    assert len(the) == 1 and tokenizer.encode(" the the", add_special_tokens=False) == the * 2
    eos = tokenizer.eos_token_id
    cases = [
        # (params, output tokens kept before it runs out)
        (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=the,
                        structured_outputs=StructuredOutputsParams(json={"type": "object"})), 0),
        (SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, min_tokens=3,
                        allowed_token_ids=[eos]), 0),
        # " the" once; after it, " the the" bans the only token left.
        (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=the,
                        bad_words=[" the the"]), 1),
    ]
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(model_path, **{"max_model_len": 256, "block_size": 16, "num_kv_blocks": 32,
                            **engine_args}) as llm:
        deferred = defer_and_record(llm) if name == "deferred" else []
        outs = llm.generate([PROMPT] * (len(cases) + 1), [p for p, _ in cases] + [free],
                            use_tqdm=False)
        stats = llm.engine.core.get_stats()
        llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    for (_, kept), out in zip(cases, outs):
        choice = out.outputs[0]
        assert choice.finish_reason == "error", choice
        assert choice.stop_reason == (
            f"no token can be sampled after {kept} output token(s): the request's allowed_token_ids, "
            f"bad_words, min_tokens and structured outputs rule out every token")
        assert list(choice.token_ids) == the * kept
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        want = reference(model_path).model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), do_sample=False,
            max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    assert list(outs[-1].outputs[0].token_ids) == want
    if name == "deferred":
        assert num_deferred(deferred) >= MAX_TOKENS - 1
    elif name == "ngram_speculation":
        assert stats.spec_decoding.num_draft_tokens > 0


def _constrained_greedy(hf_model, prompt: list[int], allowed: list[int],
                        bad_words: list[list[int]]) -> list[int]:
    """transformers' greedy choice among `allowed` less the bad words' banned last tokens (each
    banned where the output ends with the rest of its word), until no token is left."""
    out: list[int] = []
    while True:
        banned = {w[-1] for w in bad_words
                  if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]}
        left = [t for t in allowed if t not in banned]
        if not left:
            return out
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(max(left, key=lambda t: float(logits[t])))


@pytest.mark.parametrize("name,engine_args", [SETTINGS[0], SETTINGS[2]], ids=["waited", "ngram_speculation"])
def test_a_row_with_no_token_left_among_drafts_keeps_the_tokens_before_it(name, engine_args,
                                                                          model_path, reference):
    """Drafts accepted ahead of a row that has no token left stand; the request ends at that
    row with the same count as without drafts, and its tokens are transformers' choices."""
    tokenizer = load_tokenizer(model_path)
    prompt = "the cat the cat the cat the cat the cat the"
    allowed = tokenizer.encode(" the", add_special_tokens=False) + \
        tokenizer.encode(" cat", add_special_tokens=False)
    words = [" the the", " cat cat", " the cat the"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=allowed,
                            bad_words=words)
    with LLM(model_path, **{"max_model_len": 256, "block_size": 16, "num_kv_blocks": 32,
                            **engine_args}) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        stats = llm.engine.core.get_stats()
        llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    want = _constrained_greedy(reference(model_path).model, tokenizer.encode(prompt), allowed,
                               [tokenizer.encode(w, add_special_tokens=False) for w in words])
    assert 1 < len(want) < MAX_TOKENS
    assert list(out.token_ids) == want and out.finish_reason == "error", out
    assert out.stop_reason.startswith(f"no token can be sampled after {len(want)} output token(s)")
    if name == "ngram_speculation":
        assert stats.spec_decoding.num_accepted_tokens > 0


def test_a_draft_kept_before_a_row_with_no_token_left_counts_as_accepted(tiny_checkpoints):
    """Only "a" may be sampled and the grammar wants "aab": the prefill samples "a", the n-gram
    proposer drafts "a", which is kept, and the row after it has no token left. The counters
    took every step with drafts to end in one sample past those kept, and missed this one."""
    a = 81   # "a" in SmolLM2's tokenizer ("aa" is 11510, "b" is 82)
    params = SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=[a],
                            structured_outputs=StructuredOutputsParams(regex="aab"))
    with LLM(tiny_checkpoints["llama"], speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}) as llm:
        out = llm.generate({"prompt_token_ids": [a, a, a, a]}, params, use_tqdm=False)[0].outputs[0]
        stats = llm.get_stats().spec_decoding
    assert out.token_ids == [a, a] and out.finish_reason == "error"
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 1)
