"""A constrained request's other stop ids, for both grammar backends: the model's extra EOS ids
(its generation config's eos_token_id list) and the request's stop_token_ids end a constrained
output exactly as the tokenizer's EOS does. The mask allows each of them where the grammar can
end and nowhere before, and accepting one ends the request (stop_reason: that id).

A logit bias of +100 on the stop id pulls every output to it: it is written at the first point
the mask allows it, so a mask that allowed it early would end the output early, and one that
never allowed it would end on the tokenizer's EOS instead. Greedy outputs are held to
transformers' generate with each engine's own processor, built to stop on the same ids natively
(llguidance's tokenizer takes several EOS ids; xgrammar's takes its stop ids), so the reference
does not go through treadle's handling of stop ids.
"""

from __future__ import annotations

import functools
import json
import re

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
from treadle.structured_output.registry import get_backend

from tests.test_structured_outputs import MAX_TOKENS, PERSON, QUESTIONS

BACKENDS = ("guidance", "xgrammar")
EXTRA_EOS = 0   # SmolLM2's <|endoftext|>: its tokenizer's EOS is <|im_end|>
BIAS = 100.0
# Grammars that can end early: no other properties, so the object may close after "age".
CLOSED_PERSON = {**PERSON, "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=CLOSED_PERSON),
    "regex": StructuredOutputsParams(regex=r"(\+1 )?[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
}


@pytest.fixture(scope="module")
def model_path(smollm2_path) -> str:
    return prepare_model(smollm2_path)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    tokenizer = load_tokenizer(model_path)
    assert tokenizer.convert_ids_to_tokens(EXTRA_EOS) == "<|endoftext|>" != tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def two_eos_config(tmp_path_factory, tokenizer) -> str:
    """A generation config whose eos_token_id names the tokenizer's EOS and EXTRA_EOS."""
    folder = tmp_path_factory.mktemp("two_eos")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tokenizer.eos_token_id, EXTRA_EOS]}))
    return str(folder)


@pytest.fixture(scope="module")
def engines(model_path, two_eos_config):
    """engines(backend) -> an LLM with that backend and the two-EOS generation config, under
    async scheduling (deferred steps); one per backend for the module."""
    made: dict[str, LLM] = {}

    def get(backend: str) -> LLM:
        if backend not in made:
            made[backend] = LLM(model_path, max_model_len=256, block_size=16, num_kv_blocks=64,
                                structured_outputs_config={"backend": backend},
                                generation_config=two_eos_config, async_scheduling=True)
        return made[backend]

    yield get
    for llm in made.values():
        llm.shutdown()


class _Bias(transformers.LogitsProcessor):
    def __init__(self, token_id: int, bias: float) -> None:
        self.token_id, self.bias = token_id, bias

    def __call__(self, input_ids, scores):
        scores[:, self.token_id] += self.bias
        return scores


class _GuidanceProcessor(transformers.LogitsProcessor):
    """llguidance's own mask; its tokenizer (`_ll_tokenizer`) ends on several EOS ids natively."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int) -> None:
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.started = False

    def __call__(self, input_ids, scores):
        if self.started:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        self.started = True
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        xgr.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


@functools.lru_cache(maxsize=None)
def _ll_tokenizer(model_path: str, vocab: int, eos: tuple[int, ...]):
    ll_tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(model_path), n_vocab=vocab,
                                                eos_token=list(eos))
    assert sorted(ll_tokenizer.eos_tokens) == sorted(eos)
    return ll_tokenizer


@functools.lru_cache(maxsize=None)
def _xgr_compiler(model_path: str, vocab: int, eos: tuple[int, ...]) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(model_path), vocab_size=vocab,
                                              stop_token_ids=list(eos))
    return xgr.GrammarCompiler(info, max_threads=1)


def _reference_processor(backend: str, model_path: str, vocab: int,
                         params: StructuredOutputsParams, eos: tuple[int, ...]):
    if backend == "guidance":
        grammar = get_backend("guidance", model_path, vocab).compile(params)
        return _GuidanceProcessor(_ll_tokenizer(model_path, vocab, eos), grammar, vocab)
    compiler = _xgr_compiler(model_path, vocab, eos)
    if params.kind == "json":
        compiled = compiler.compile_json_schema(json.dumps(params.json))
    elif params.kind == "regex":
        compiled = compiler.compile_regex(params.regex)
    else:
        compiled = compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c) for c in params.choice))
    return xgr.contrib.hf.LogitsProcessor(compiled)


def _hf_constrained(hf_model, tokenizer, model_path: str, backend: str,
                    params: StructuredOutputsParams, prompt: list[int], eos: tuple[int, ...]
                    ) -> list[int]:
    """transformers' greedy generate, EXTRA_EOS biased, under the engine's own processor."""
    vocab = hf_model.config.vocab_size
    processor = _reference_processor(backend, model_path, vocab, params, eos)
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=MAX_TOKENS,
            logits_processor=[_Bias(EXTRA_EOS, BIAS), processor],
            eos_token_id=list(eos), pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


def _assert_in_grammar(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), CLOSED_PERSON)
    elif kind == "regex":
        assert re.fullmatch(CONSTRAINTS["regex"].regex, text), text
    else:
        assert text in CONSTRAINTS["choice"].choice, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_models_extra_eos_ends_a_constrained_output(backend, engines, model_path, tokenizer,
                                                        prompts, reference):
    """The generation config's second EOS id, never in the request, ends each output where its
    grammar can first end; greedy tokens equal transformers'."""
    hf_model = reference(model_path).model
    eos = tokenizer.eos_token_id
    llm = engines(backend)
    assert llm.engine.input_processor.more_eos_token_ids == [EXTRA_EOS]
    for kind, constraint in CONSTRAINTS.items():
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint,
                                logit_bias={EXTRA_EOS: BIAS})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            got = out.outputs[0]
            ids = list(got.token_ids)
            assert got.finish_reason == "stop" and got.stop_reason == EXTRA_EOS, (kind, got)
            assert ids[-1] == EXTRA_EOS and not {EXTRA_EOS, eos} & set(ids[:-1]), (kind, ids)
            _assert_in_grammar(kind, got.text)
            want = _hf_constrained(hf_model, tokenizer, model_path, backend, constraint, prompt,
                                   (eos, EXTRA_EOS))
            assert ids == want, (kind, got.text, tokenizer.decode(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_token_id_that_is_text_is_only_a_stop(backend, engines, tokenizer):
    """A request's stop_token_ids entry that the grammar could read as text ("yes" of a choice)
    is a stop only: not allowed before the grammar can end (its text would be dropped from the
    output, which would then break the grammar), allowed and ending the output after."""
    yes = tokenizer.convert_tokens_to_ids("yes")
    assert tokenizer.encode("yes", add_special_tokens=False) == [yes]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is the sky blue? Answer yes or no."}], tokenize=False,
        add_generation_prompt=True)
    out = engines(backend).generate([prompt], SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[yes], logit_bias={yes: BIAS},
        structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    assert out.finish_reason == "stop" and out.stop_reason == yes, out
    assert ids[-1] == yes and yes not in ids[:-1], ids
    assert out.text in ("yes", "no"), out   # "yes" only spelled in other tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_stop_ids(backend, model_path, tokenizer):
    """The matcher's side, on the real engines: masks, accept, drafts (valid_prefix), rollback
    past a stop, and an engine's own EOS refused where it is not one of the request's."""
    vocab = len(tokenizer)
    b = get_backend(backend, model_path, vocab)
    eos, yes, no = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("yes"), \
        tokenizer.convert_tokens_to_ids("no")
    # "yes" completes the grammar as text: xgrammar by itself would take it so, as a stop.
    compiled = b.compile(StructuredOutputsParams(choice=["yes", "yes please", "no"]))
    stops = [eos, EXTRA_EOS, yes]

    def allowed(matcher, tokens):
        row = b.allocate_bitmask(1)
        matcher.fill_bitmask(row, 0)
        return [t for t in tokens if (int(row[0, t // 32]) >> (t % 32)) & 1]

    m = b.matcher(compiled, stops)
    assert allowed(m, stops + [no]) == [no]   # "yes" is text of the grammar, but a stop here
    assert not any(m.accept(t) for t in stops) and not m.is_terminated()
    assert m.accept(no)
    assert allowed(m, stops) == stops
    for stop in stops:
        assert m.valid_prefix([stop, no]) == 1 and not m.is_terminated()
        assert m.accept(stop) and m.is_terminated()
        assert not m.accept(no) and not m.accept(stop)
        allowed(m, stops)   # the row after a draft that stops is filled (never kept): no error
        m.rollback(1)
        assert not m.is_terminated() and allowed(m, stops) == stops
    assert m.accept(EXTRA_EOS)
    m.rollback(2)   # past the stop and "no": the grammar's start again
    assert not m.is_terminated() and allowed(m, stops + [no]) == [no]

    # Stop ids without the tokenizer's EOS: the engines' own EOS is never allowed.
    m = b.matcher(compiled, [EXTRA_EOS])
    assert m.accept(no) and allowed(m, [eos, EXTRA_EOS]) == [EXTRA_EOS]
    assert not m.accept(eos) and m.accept(EXTRA_EOS) and m.is_terminated()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_id_among_accepted_drafts_ends_the_output(backend, model_path, tokenizer,
                                                         reference):
    """A chat whose earlier answers were "yes<|im_end|>": the n-gram drafts after "yes" propose
    the EOS, the grammar can end there, and the sample agrees, so the stop and the bonus token
    after it are accepted together. The output ends at the stop, as transformers' does (the
    terminated matcher once refused the bonus token and ended the request with an error)."""
    messages = []
    for q in ["Is the sky blue?", "Is water wet?", "Is fire hot?"]:
        messages += [{"role": "user", "content": q + " Answer yes or no."},
                     {"role": "assistant", "content": "yes"}]
    messages.append({"role": "user", "content": "Is snow cold? Answer yes or no."})
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    eos = tokenizer.eos_token_id
    with LLM(model_path, max_model_len=512, block_size=16, num_kv_blocks=64,
             structured_outputs_config={"backend": backend}, speculative_config=NGRAM) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint),
                           use_tqdm=False)[0].outputs[0]
        stats = llm.engine.core.get_stats()
    hf_model = reference(model_path).model
    processor = _reference_processor(backend, model_path, hf_model.config.vocab_size, constraint,
                                     (eos,))
    with torch.inference_mode():
        want = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=8, logits_processor=[processor], eos_token_id=eos,
            pad_token_id=eos)[0, len(prompt):].tolist()
    assert want[-1] == eos
    assert list(out.token_ids) == want and out.finish_reason == "stop", out
    assert stats.spec_decoding.num_accepted_tokens > 0
