"""vLLM's bad_words: greedy output of the embedded SmolLM2 against transformers' `generate` with
`bad_words_ids` set to the same token sequences, with every step waited for, with every step
deferred (the word's check reads the previous token on the device), and with n-gram drafts.

The prompts make the model want the words: a one-token word banned everywhere, a three-token
word whose last token is banned only after the first two, and a two-token word whose last token
the model also writes after other tokens, where it must stay.
"""

from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.models.loader import load_tokenizer, prepare_model

from tests.deferred import defer_and_record, num_deferred

PROMPTS = ["Q: What is the capital of France?\nA:",
           "Repeat after me: the Eiffel Tower, the Eiffel Tower, the Eiffel Tower,",
           "Famous landmarks in Paris include the"]
# " de" is also in "Notre Dame de la Cité", which must stay: "Arc de" bans it after " Arc" only.
# "in Paris" ends with " Paris" as "Paris" does: the one ban must hold where the other's check
# (on the device, under deferred steps) fails.
BAD_WORDS = ["Paris", "Eiffel Tower", "Arc de", "in Paris"]
MAX_TOKENS = 24


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
def test_bad_words_equal_transformers_bad_words_ids(name, engine_args, model_path, reference):
    tokenizer = load_tokenizer(model_path)
    with LLM(model_path, **{"max_model_len": 256, "block_size": 16, "num_kv_blocks": 32,
                            **engine_args}) as llm:
        deferred = defer_and_record(llm) if name == "deferred" else []
        banned = llm.engine.input_processor.bad_words_token_ids(BAD_WORDS)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=BAD_WORDS)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        stats = llm.engine.core.get_stats()
    assert any(len(word) >= 3 for word in banned)   # one word checked across tokens
    hf = reference(model_path).model
    for prompt, out, unbanned in zip(PROMPTS, outs, free):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                               do_sample=False, max_new_tokens=MAX_TOKENS, bad_words_ids=banned,
                               pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        assert list(out.outputs[0].token_ids) == want, out.outputs[0].text
        # The evidence: unbanned, the model writes the word.
        text = unbanned.outputs[0].text
        assert any(w in text for w in BAD_WORDS), text
        assert not any(w in out.outputs[0].text for w in BAD_WORDS), out.outputs[0].text
    if name == "deferred":
        assert num_deferred(deferred) > MAX_TOKENS
    elif name == "ngram_speculation":
        assert stats.spec_decoding.num_draft_tokens > 0


def test_bad_words_outside_the_vocabulary_are_refused(model_path):
    llm = LLM(model_path, max_model_len=64, block_size=16, num_kv_blocks=8)
    llm.engine.input_processor.vocab_size = 100   # as a tokenizer with more tokens than the model
    with pytest.raises(ValueError, match=r"bad_words: 'Paris' has tokens outside the vocabulary \[0, 100\)"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1, bad_words=["Paris"]),
                     use_tqdm=False)


@pytest.mark.parametrize("words, message", [
    ([""], "bad_words must be a list of non-blank strings or None"),
    ([3], "bad_words must be a list of non-blank strings or None, got [3] (list)"),
])
def test_bad_bad_words_are_refused(words, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(bad_words=words)
