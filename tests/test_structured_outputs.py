"""Structured outputs offline: greedy constrained output against transformers `generate` with the
grammar engine's own logits processor, under every scheduling feature; sampled outputs against
`jsonschema`; constrained and free requests in one batch; bad constraints.

The model is the embedded SmolLM2-135M-Instruct: a tiny random model would not write JSON, so
the masks would decide nearly every token and hide a wrong one.
"""

from __future__ import annotations

import functools
import json
import logging

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
import transformers
import xgrammar as xgr

from treadle import LLM, SamplingParams, StructuredOutputsParams
from treadle.models.loader import load_tokenizer, prepare_model
from treadle.request import Request
from treadle.structured_output.registry import get_backend
from treadle.worker.deferred_step import DeferredStep

from tests.deferred import defer_and_record, num_deferred
from tests.test_grammar_gate import GATE_LOG, slow_schema

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
QUESTIONS = ["Describe a person as JSON.", "Tell me about Alice, who is 30.",
             "What is the phone number of the office?"]
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "regex": StructuredOutputsParams(regex=r"(\+1 )?[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_path(smollm2_path) -> str:
    return prepare_model(smollm2_path)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


class GuidanceLogitsProcessor(transformers.LogitsProcessor):
    """llguidance ships no transformers processor; this is the minimal one, on its own API."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int) -> None:
        ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.prompt_len: int | None = None

    def __call__(self, input_ids, scores):
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        else:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        xgr.apply_token_bitmask_inplace(scores, self.bitmask)   # llguidance's would torch.compile
        return scores


@functools.lru_cache(maxsize=None)
def _hf_constrained(reference_model, model_path: str, backend: str, kind: str,
                    prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy generate under the backend's own logits processor; EOS ends it."""
    tokenizer = load_tokenizer(model_path)
    vocab = reference_model.config.vocab_size
    params = CONSTRAINTS[kind]
    if backend == "xgrammar":
        compiled = get_backend("xgrammar", model_path, vocab).compile(params)
        processor = xgr.contrib.hf.LogitsProcessor(compiled)
    else:
        processor = GuidanceLogitsProcessor(tokenizer, get_backend("guidance", model_path, vocab)
                                            .compile(params), vocab)
    with torch.inference_mode():
        out = reference_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=MAX_TOKENS, logits_processor=[processor],
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


def _assert_equal_to_transformers(llm: LLM, reference, model_path, prompts, backend="xgrammar"):
    hf_model = reference(model_path).model
    eos = llm.get_tokenizer().eos_token_id
    for kind, constraint in CONSTRAINTS.items():
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            got = out.outputs[0]
            want = _hf_constrained(hf_model, model_path, backend, kind, tuple(prompt))
            assert list(got.token_ids) == want, (kind, got.text)
            # Both keep the EOS that ended the output.
            assert got.finish_reason == ("stop" if want[-1] == eos else "length"), (kind, got.text)


# (name, engine arguments, what must have happened for the run to prove anything)
SETTINGS = [
    ("batched", {}, None),
    ("chunked_prefill", {"max_num_batched_tokens": 16}, None),
    ("preemption", {"num_kv_blocks": 9, "max_model_len": 128}, "preemptions"),
    # Deferred steps, as the in-process executor runs them on a GPU: a step's mask waits for the
    # previous step's tokens after its forward pass is queued (worker/deferred_step.py).
    ("async_scheduling_deferred", {"async_scheduling": True}, "deferred"),
    ("ngram_speculation", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
     "drafts"),
    # Worker processes: the last stage samples and masks while the first runs ahead.
    ("two_pipeline_stages_async", {"pipeline_parallel_size": 2, "async_scheduling": True,
                                   "max_num_batched_tokens": 24}, None),
]


@pytest.mark.parametrize("name,engine_args,evidence", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_greedy_constrained_output_equals_transformers(name, engine_args, evidence, model_path,
                                                       prompts, reference):
    with LLM(model_path, **{"max_model_len": 256, "block_size": 16, "num_kv_blocks": 64,
                            **engine_args}) as llm:
        deferred = defer_and_record(llm) if evidence == "deferred" else []
        _assert_equal_to_transformers(llm, reference, model_path, prompts)
        stats = llm.engine.core.get_stats()
    if evidence == "preemptions":
        assert stats.num_preemptions > 0
    elif evidence == "drafts":
        assert stats.spec_decoding.num_draft_tokens > 0
    elif evidence == "deferred":
        # Every step that sampled deferred its tokens.
        assert num_deferred(deferred) > 30
        assert not any(any(out.sampled_token_ids) for out in deferred if not isinstance(out, DeferredStep))


def test_guidance_backend_equals_transformers(model_path, prompts, reference):
    llm = LLM(model_path, max_model_len=256, block_size=16, num_kv_blocks=64, async_scheduling=True,
              structured_outputs_config={"backend": "guidance"})
    _assert_equal_to_transformers(llm, reference, model_path, prompts, backend="guidance")


SCHEMAS = {
    "nested": {"type": "object", "required": ["person"], "properties": {"person": {
        "type": "object", "required": ["name", "address"], "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "required": ["city", "zip"], "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array": {"type": "object", "required": ["tags"], "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}},
    "enum_and_bounds": {"type": "object", "required": ["color", "score", "count"], "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "person": PERSON,
}
NUM_SAMPLES = 50


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.fixture(scope="module")
def sampling_llm(model_path) -> LLM:
    return LLM(model_path, max_model_len=512, block_size=16, num_kv_blocks=400)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_validate_against_the_schema(name, sampling_llm, tokenizer):
    schema = SCHEMAS[name]
    prompt = _chat(tokenizer, "Reply with JSON.")
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, seed=7, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=schema))
    samples = sampling_llm.generate([prompt], params, use_tqdm=False)[0].outputs
    finished = [s for s in samples if s.finish_reason == "stop"]
    assert len(finished) >= NUM_SAMPLES * 0.8, [s.text for s in samples]
    for s in finished:
        jsonschema.validate(json.loads(s.text), schema)
    assert len({s.text for s in finished}) > NUM_SAMPLES // 2   # sampled, not one answer


def test_guidance_sampled_outputs_validate(model_path, tokenizer):
    llm = LLM(model_path, max_model_len=512, block_size=16, num_kv_blocks=200,
              structured_outputs_config={"backend": "guidance"})
    schema = SCHEMAS["enum_and_bounds"]
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, seed=3, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=schema))
    samples = llm.generate([_chat(tokenizer, "Reply with JSON.")], params, use_tqdm=False)[0].outputs
    finished = [s for s in samples if s.finish_reason == "stop"]
    # Its free whitespace runs longer than xgrammar's on this model: fewer finish in 100 tokens.
    assert len(finished) >= NUM_SAMPLES // 2
    for s in finished:
        jsonschema.validate(json.loads(s.text), schema)


def test_free_requests_are_untouched_by_constrained_neighbours(model_path, prompts, reference):
    """Free rows in a batch with constrained ones decode exactly as transformers' greedy."""
    llm = LLM(model_path, max_model_len=256, block_size=16, num_kv_blocks=64)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests, params = [], []
    for i, prompt in enumerate(prompts):
        for kind, constraint in CONSTRAINTS.items():
            requests.append({"prompt_token_ids": prompt})
            params.append(SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint)
                          if (i + len(params)) % 2 else free)
    outs = llm.generate(requests, params, use_tqdm=False)
    hf = reference(model_path)
    num_free = 0
    for request, p, out in zip(requests, params, outs):
        if p.structured_outputs is None:
            num_free += 1
            assert list(out.outputs[0].token_ids) == hf.greedy(request["prompt_token_ids"], 24)
    assert 0 < num_free < len(requests)


def test_output_cut_by_max_tokens_is_length_and_frees_its_blocks(model_path):
    llm = LLM(model_path, max_model_len=256, block_size=16, num_kv_blocks=64)
    never_ends = StructuredOutputsParams(grammar='root ::= "a" root | "b" root')
    out = llm.generate(["Say a"], SamplingParams(temperature=0, max_tokens=12,
                                                 structured_outputs=never_ends), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12
    assert set(out.outputs[0].text) <= {"a", "b"}
    assert llm.reset_prefix_cache()   # succeeds only with no block held


@pytest.mark.parametrize("constraint,message", [
    ({"json": {"type": "objectx"}}, "invalid structured_outputs.json: Unsupported type"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"regex": "a(b"}, "invalid structured_outputs.regex: Regex parsing error"),
    ({"grammar": "root ::= missing"}, 'invalid structured_outputs.grammar: EBNF parser error'),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of json, json_object, regex, choice, grammar"),
    ({}, "exactly one of"),
    ({"jsonn": {}}, "unknown keys ['jsonn']"),
])
def test_bad_constraints_are_refused_before_the_engine(constraint, message, sampling_llm):
    with pytest.raises(ValueError) as info:
        sampling_llm.generate(["Hi"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert message in str(info.value)
    assert not sampling_llm.engine.core.has_unfinished_requests()


def test_parameters_that_overrule_the_grammar_are_refused():
    with pytest.raises(ValueError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match="ignore_eos must be False with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})


def test_a_grammar_that_fails_to_compile_ends_its_request_with_error(sampling_llm, prompts):
    """Past the front end's check (a request built by hand): the compile fails on the engine's
    compile thread, and the request ends with finish_reason "error" and the message; the
    other request runs."""
    core, eos = sampling_llm.engine.core, sampling_llm.get_tokenizer().eos_token_id
    bad = Request("bad", prompts[0], SamplingParams(structured_outputs={"regex": "a(b"}), eos)
    good = Request("good", prompts[1], SamplingParams(temperature=0, max_tokens=8,
                                                      structured_outputs={"regex": "[0-9]+"}), eos)
    core.add_request(bad)
    core.add_request(good)
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(Request("bad", prompts[0], SamplingParams(), eos))
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == "error"
    assert "Regex parsing error" in finished["bad"].stop_reason
    assert finished["good"].finish_reason in ("stop", "length")


# Constraints that no output satisfies; the grammar engines let a token or two through first.
UNSATISFIABLE = {
    "regex": {"regex": r"a[^\s\S]b"},
    "empty_regex": {"regex": r"[^\s\S]"},
    "json_pattern": {"json": {"type": "string", "pattern": "^a[^\\s\\S]b$"}},
    "grammar": {"grammar": 'root ::= "a" [^\\x00-\\U0010FFFF]'},
}


@pytest.fixture(scope="module")
def async_llm(model_path) -> LLM:
    """Async scheduling with deferred steps, as on a GPU: a refused token is found when its
    step finishes, with the next step's token already counted in the slot."""
    llm = LLM(model_path, max_model_len=256, block_size=16, num_kv_blocks=64,
              async_scheduling=True)
    assert llm.engine.core.executor.worker.runner.allow_deferred_steps()
    return llm


def _ends_only_its_own_request(llm: LLM, constraint: dict) -> str:
    """The unsatisfiable request ends with finish_reason "error" and why; its neighbours in the
    batch, constrained and free, finish, and so do later requests. Returns its text."""
    outs = llm.generate(["Say hi", "Pick a colour.", "The capital of France is"], [
        SamplingParams(temperature=0.8, seed=1, max_tokens=8, structured_outputs=constraint),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["red", "blue"]}),
        SamplingParams(temperature=0, max_tokens=8)], use_tqdm=False)
    bad, choice, free = (o.outputs[0] for o in outs)
    assert bad.finish_reason == "error", bad
    assert bad.stop_reason == ("structured_outputs cannot be satisfied: its grammar allows no "
                               f"token after {len(bad.token_ids)} output token(s)"), bad.stop_reason
    assert choice.finish_reason == "stop" and choice.text in ("red", "blue")
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    again = llm.generate(["Pick a colour."], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs={"choice": ["red", "blue"]}), use_tqdm=False)
    assert again[0].outputs[0].text == choice.text
    assert llm.reset_prefix_cache()   # no block left held
    return bad.text


@pytest.mark.parametrize("kind", list(UNSATISFIABLE))
def test_an_unsatisfiable_grammar_ends_only_its_own_request(kind, async_llm):
    text = _ends_only_its_own_request(async_llm, UNSATISFIABLE[kind])
    assert text in ("", "a", '"a')   # what the grammar allowed before its dead end


def test_an_unsatisfiable_grammar_ends_only_its_own_request_with_guidance(model_path):
    llm = LLM(model_path, max_model_len=256, block_size=16, num_kv_blocks=64,
              structured_outputs_config={"backend": "guidance"})
    for kind in ("regex", "empty_regex"):   # llguidance sees the dead end before any token
        assert _ends_only_its_own_request(llm, UNSATISFIABLE[kind]) == ""
    # Its JSON-schema compiler proves an empty pattern unsatisfiable up front.
    with pytest.raises(ValueError, match="Unsatisfiable schema"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=UNSATISFIABLE["json_pattern"]))


def test_abort_while_compiling_and_pause_abort(sampling_llm, prompts, caplog):
    """An abort, and pause(abort), reach requests whose grammar still compiles: the grammar is
    slow on purpose, and the gate's log says that each compile was running when its request
    was dropped."""
    core, eos = sampling_llm.engine.core, sampling_llm.get_tokenizer().eos_token_id
    slow = {"json": slow_schema()}
    with caplog.at_level(logging.INFO, logger=GATE_LOG):
        core.add_request(Request("a", prompts[0], SamplingParams(structured_outputs=slow), eos))
        core.abort_requests(["a"])
        core.add_request(Request("b", prompts[0], SamplingParams(structured_outputs=slow), eos))
        core.pause(mode="abort")
    assert "request a: dropped while its grammar compiles" in caplog.text
    assert "request b: dropped while its grammar compiles" in caplog.text
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("b", "abort")]
    core.resume()
    assert core.is_idle() and sampling_llm.reset_prefix_cache()
