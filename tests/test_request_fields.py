"""Request fields that used to be ignored or refused (issue 44): logit_bias, the chat template's
options, vLLM's guided_* names, and the rule that no field is silently ignored.

A real `treadle serve` of the tiny Llama, whose chat template is SmolLM2's plus two variables
(`enable_thinking`, `documents`), driven by the openai SDK; outputs are compared with
transformers and prompts with `tokenizer.apply_chat_template` given the same arguments.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.test_server import ENGINE_ARGS, MODEL, Server, assert_error
from treadle import LLM, SamplingParams
from treadle.models.loader import load_tokenizer

# SmolLM2's template with a variable of its own, a retrieval section and the tools in front.
EXTRA_TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}"
                  "{{ '<|im_start|>system\n/no_think<|im_end|>\n' }}{% endif %}"
                  "{% for doc in documents or [] %}"
                  "{{ '<|im_start|>document\n' + doc['text'] + '<|im_end|>\n' }}{% endfor %}"
                  "{% for tool in tools or [] %}"
                  "{{ '<|im_start|>tool\n' + tool['function']['name'] + '<|im_end|>\n' }}{% endfor %}")
ASK = [{"role": "user", "content": "Name a colour."}]
CONTINUE = ASK + [{"role": "assistant", "content": "The colour I like best is"}]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoints, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("templated") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    tokenizer = load_tokenizer(str(path))
    tokenizer.chat_template = EXTRA_TEMPLATE + tokenizer.chat_template
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    srv = Server(model_path, tmp_path_factory.mktemp("server"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def bad_request(call: Any, **kwargs: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(model=MODEL, **kwargs)
    assert e.value.body["code"] == 400
    return e.value


# -- logit_bias ----------------------------------------------------------------------------------
class Bias(LogitsProcessor):
    """transformers' side of logit_bias: the same values added to the logits."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias))
        self.values = torch.tensor(list(bias.values()))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.ids] += self.values
        return scores


def hf_greedy(reference, ids: list[int], max_new_tokens: int, bias: dict[int, float]) -> list[int]:
    out = reference.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                   max_new_tokens=max_new_tokens, do_sample=False,
                                   logits_processor=LogitsProcessorList([Bias(bias)]),
                                   pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_logit_bias_equals_transformers_with_the_bias(client, model_path, tokenizer, reference):
    """Greedy: a bias that forbids the unbiased choices (and EOS, so that neither side stops)
    and favours another token; the output is the one transformers gives with the same bias."""
    ref = reference(model_path)
    ids = tokenizer.encode("The capital of France is")
    plain = ref.greedy(ids, 3)
    bias = {plain[0]: -100.0, plain[1]: -100.0, 1234: 6.5, tokenizer.eos_token_id: -100.0}
    expected = hf_greedy(ref, ids, 12, bias)
    assert expected[0] != plain[0]
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                     logit_bias={str(k): v for k, v in bias.items()},
                                     extra_body={"return_token_ids": True})
    assert resp.choices[0].token_ids == expected
    # Forcing: +100 on one token makes every output token that one, in chat too.
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                          logit_bias={"1234": 100})
    assert chat.choices[0].message.content == tokenizer.decode([1234] * 4)


def test_logit_bias_offline(model_path, tokenizer, reference):
    llm = LLM(model_path, **ENGINE_ARGS)
    ids = tokenizer.encode("Once upon a time")
    bias = {42: 5.0, 99: 3.0, tokenizer.eos_token_id: -100.0}
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0, max_tokens=8, logit_bias=bias),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(reference(model_path), ids, 8, bias)
    with pytest.raises(ValueError, match=r"logit_bias names token 49152, outside the vocab"):
        llm.generate(["x"], SamplingParams(logit_bias={49152: 1.0}), use_tqdm=False)


@pytest.mark.parametrize("bias, message", [
    ({"49152": 1}, "logit_bias names token 49152, outside the vocabulary [0, 49152)"),
    ({"7": 100.5}, "logit_bias['7'] must be in [-100, 100], got 100.5"),
    ({"seven": 1}, "logit_bias keys must be token ids"),
])
def test_bad_logit_bias_is_a_400_naming_it(client, bias, message):
    for call, kwargs in ((client.completions.create, {"prompt": "x"}),
                         (client.chat.completions.create, {"messages": ASK})):
        e = bad_request(call, logit_bias=bias, max_tokens=2, **kwargs)
        assert message in e.message and e.body["param"] == "logit_bias", e.body


# -- allowed_token_ids --------------------------------------------------------------------------
def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(client, model_path, tokenizer,
                                                                    reference):
    """Greedy: only the allowed tokens (the unconstrained choice not among them) come out, as
    transformers gives them with prefix_allowed_tokens_fn; sampled, seeded: only they too."""
    ref = reference(model_path)
    ids = tokenizer.encode("The capital of France is")
    plain = ref.greedy(ids, 1)
    allowed = [t for t in (7, 42, 99, 1234, 4000, plain[0] + 1) if t != plain[0]]
    out = ref.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                             max_new_tokens=10, do_sample=False, pad_token_id=0,
                             prefix_allowed_tokens_fn=lambda batch, seen: allowed)
    expected = out[0, len(ids):].tolist()
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                     extra_body={"allowed_token_ids": allowed,
                                                 "return_token_ids": True})
    assert resp.choices[0].token_ids == expected
    sampled = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, temperature=1.5, seed=3, logprobs=True,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(sampled.choices[0].token_ids) <= set(allowed)
    llm = LLM(model_path, **ENGINE_ARGS)
    offline = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=10, allowed_token_ids=allowed), use_tqdm=False)
    assert offline[0].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match=r"allowed_token_ids names token 49152, outside the vocab"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[49152]), use_tqdm=False)


def test_bad_words_reach_the_engine(client, model_path, tokenizer):
    """bad_words over HTTP gives what the engine gives offline (held to transformers in
    test_bad_words.py), and a bad list is a 400 naming the field."""
    ids = tokenizer.encode("The capital of France is")
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    word = plain.choices[0].text.split()[0]
    llm = LLM(model_path, **ENGINE_ARGS)
    offline = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "bad_words": [word]})
    assert resp.choices[0].text == offline.outputs[0].text != plain.choices[0].text
    e = bad_request(client.completions.create, prompt="x", max_tokens=2,
                    extra_body={"bad_words": [" "]})
    assert e.body["param"] == "bad_words" and "non-blank strings" in e.message


@pytest.mark.parametrize("allowed, message", [
    ([49152], "allowed_token_ids names token 49152, outside the vocabulary [0, 49152)"),
    ([], "allowed_token_ids must be a non-empty list of token ids >= 0 or None"),
    ([-1], "allowed_token_ids must be a non-empty list of token ids >= 0 or None, holding -1"),
])
def test_bad_allowed_token_ids_are_a_400_naming_them(client, allowed, message):
    e = bad_request(client.completions.create, prompt="x", max_tokens=2,
                    extra_body={"allowed_token_ids": allowed})
    assert message in e.message and e.body["param"] == "allowed_token_ids", e.body


def test_allowed_token_ids_that_leave_no_token_end_the_request_not_the_server(server, client,
                                                                             tokenizer):
    """Only EOS allowed before min_tokens: the request ends with the reason (tests/test_ruled_out.py
    offline), a 200, whole and streamed; the server serves on."""
    body = {"allowed_token_ids": [tokenizer.eos_token_id], "min_tokens": 2}
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
    assert resp.choices[0].finish_reason == "error" and resp.choices[0].text == ""
    assert resp.choices[0].model_extra["stop_reason"].startswith("no token can be sampled after 0")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        extra_body=body))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
    assert server.request("GET", "/health")[0] == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


# -- truncate_prompt_tokens -----------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model_path, tokenizer, reference):
    """vLLM's left truncation: the output is transformers' on the last k tokens, and the
    response reports (and echoes) the prompt that ran."""
    ids = tokenizer.encode("One two three four five six seven eight nine ten eleven twelve")
    kept = ids[-5:]
    expected = reference(model_path).greedy(kept, 6)
    resp = client.completions.create(
        model=MODEL, prompt=tokenizer.decode(ids), max_tokens=6, temperature=0, echo=True,
        extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True, "ignore_eos": True,
                    "add_special_tokens": False})
    choice = resp.choices[0]
    assert choice.prompt_token_ids == kept and choice.token_ids == expected
    assert resp.usage.prompt_tokens == 5
    assert choice.text.startswith(tokenizer.decode(kept))
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert chat.prompt_token_ids == template_ids(tokenizer, ASK)[-4:]
    # -1: the model's context; a prompt within it is whole.
    whole = client.completions.create(model=MODEL, prompt=kept, max_tokens=1, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 5
    llm = LLM(model_path, **ENGINE_ARGS)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == kept and out.outputs[0].token_ids == expected


# -- vLLM's streaming and logprob options ---------------------------------------------------------
def test_continuous_usage_stats_count_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for call, kwargs in ((client.completions.create, {"prompt": "Once upon a time"}),
                         (client.chat.completions.create, {"messages": ASK})):
        chunks = list(call(model=MODEL, max_tokens=6, temperature=0, stream=True,
                           stream_options=options, **kwargs,
                           extra_body={"ignore_eos": True, "return_token_ids": True}))
        *parts, last = chunks
        so_far = 0
        for chunk in parts:
            so_far += len(chunk.choices[0].token_ids or [])   # none in chat's role chunk
            assert chunk.usage.completion_tokens == so_far and chunk.usage.prompt_tokens == last.usage.prompt_tokens
            assert chunk.usage.total_tokens == so_far + chunk.usage.prompt_tokens
        assert not last.choices and last.usage.completion_tokens == so_far == 6
    # As vLLM's: continuous_usage_stats alone means include_usage too; an explicit false, none.
    alone = list(client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is not None for c in alone) and not alone[-1].choices
    # stream_options given at all asks for the usage chunk (vLLM's include_usage defaults true).
    empty = list(client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                           stream_options={}))
    assert not empty[-1].choices and empty[-1].usage.completion_tokens == 2
    assert all(c.usage is None for c in empty[:-1])
    # An explicit false, or null (vLLM reads bool(include_usage)), streams no usage at all.
    for value in (False, None):
        off = list(client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                             stream_options={"continuous_usage_stats": True,
                                                             "include_usage": value}))
        assert all(c.usage is None and c.choices for c in off), value


def test_continuous_usage_stats_count_each_choice_apart(client):
    """As vLLM (and OpenAI) stream n > 1: one choice a chunk, and its usage counts that choice's
    tokens so far, not its siblings'; the last chunk counts them all."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for call, kwargs in ((client.completions.create, {"prompt": "Once upon a time"}),
                         (client.chat.completions.create, {"messages": ASK})):
        chunks = list(call(model=MODEL, n=2, max_tokens=6, temperature=1.0, seed=2, stream=True,
                           stream_options=options, **kwargs,
                           extra_body={"ignore_eos": True, "return_token_ids": True}))
        *parts, last = chunks
        so_far = {0: 0, 1: 0}
        for chunk in parts:
            if chunk.choices[0].token_ids is None:   # chat's role chunk: no token yet
                assert chunk.usage.completion_tokens == 0
                continue
            [choice] = chunk.choices
            so_far[choice.index] += len(choice.token_ids)
            assert chunk.usage.completion_tokens == so_far[choice.index]
            assert chunk.usage.prompt_tokens == last.usage.prompt_tokens
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + so_far[choice.index]
        assert so_far == {0: 6, 1: 6} and last.usage.completion_tokens == 12


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, tokenizer):
    ask = dict(model=MODEL, max_tokens=5, temperature=0)
    named = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    plain = client.completions.create(prompt="Once upon a time", logprobs=2, **ask)
    done = client.completions.create(prompt="Once upon a time", logprobs=2, extra_body=named, **ask)
    ids = done.choices[0].token_ids
    lp, plain_lp = done.choices[0].logprobs, plain.choices[0].logprobs
    assert done.choices[0].text == plain.choices[0].text
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert lp.token_logprobs == plain_lp.token_logprobs and lp.text_offset == plain_lp.text_offset
    assert all(all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    chat = client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=2,
                                          extra_body=named, **ask).choices[0]
    assert [c.token for c in chat.logprobs.content] == [f"token_id:{t}" for t in chat.token_ids]
    assert all(t.token.startswith("token_id:") and t.bytes == list(t.token.encode())
               for c in chat.logprobs.content for t in c.top_logprobs)
    # As vLLM: the chosen token's bytes are its text's, as without the option.
    plain_chat = client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=2,
                                                **ask).choices[0]
    chosen_bytes = [c.bytes for c in chat.logprobs.content]
    assert chosen_bytes == [c.bytes for c in plain_chat.logprobs.content]
    assert chosen_bytes == [list(tokenizer.decode([t]).encode()) for t in chat.token_ids]
    # Streamed completions keep their text offsets.
    streamed = client.completions.create(prompt="Once upon a time", logprobs=2, stream=True,
                                         extra_body=named, **ask)
    offsets = [o for chunk in streamed for o in chunk.choices[0].logprobs.text_offset]
    assert offsets == plain_lp.text_offset
    # As vLLM: each chunk's first offset is the length of the text streamed before it, even
    # where a stop string holds text back while its tokens go out.
    held = client.completions.create(model=MODEL, prompt="Once upon a time", logprobs=0,
                                     stream=True, stop=["a stop string that never comes"],
                                     max_tokens=12, temperature=0,
                                     extra_body={**named, "ignore_eos": True})
    text, held_back = "", False
    for chunk in held:
        [choice] = chunk.choices
        if choice.logprobs.tokens:
            assert choice.logprobs.text_offset[0] == len(text)
            held_back |= not choice.text
        text += choice.text
    assert held_back


# -- the chat template's options -----------------------------------------------------------------
def template_ids(tokenizer, messages: list[dict], **kwargs: Any) -> list[int]:
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages, body, kwargs", [
    (ASK, {}, {}),
    (ASK, {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    (ASK, {"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
    (ASK, {"documents": [{"title": "t", "text": "Blue is calm."}]},
     {"documents": [{"title": "t", "text": "Blue is calm."}]}),
    (ASK, {"add_generation_prompt": False}, {"add_generation_prompt": False}),
    (ASK, {"chat_template_kwargs": {"add_generation_prompt": False}},
     {"add_generation_prompt": False}),
    (CONTINUE, {"continue_final_message": True, "add_generation_prompt": False},
     {"continue_final_message": True, "add_generation_prompt": False}),
])
def test_prompt_is_the_template_with_the_same_arguments(server, client, tokenizer, messages, body,
                                                      kwargs):
    """The same on /v1/chat/completions and /tokenize, which take the same options."""
    expected = template_ids(tokenizer, messages, **kwargs)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          temperature=0,
                                          extra_body={"return_token_ids": True, **body})
    assert resp.prompt_token_ids == expected
    assert server.request("POST", "/tokenize", {"messages": messages, **body}) == (
        200, {"count": len(expected), "max_model_len": 256, "tokens": expected})
    assert resp.usage.prompt_tokens == len(expected)
    if body.get("chat_template_kwargs", {}).get("enable_thinking") is False:
        assert "/no_think" in tokenizer.decode(expected)


def test_add_special_tokens_puts_bos_before_the_template(client, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                          extra_body={"return_token_ids": True,
                                                      "add_special_tokens": True})
    text = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert resp.prompt_token_ids == tokenizer.encode(text, add_special_tokens=True)


def test_echo_continues_the_final_message(client):
    body = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    prefix = CONTINUE[-1]["content"]
    whole = client.chat.completions.create(model=MODEL, messages=CONTINUE, max_tokens=6,
                                           temperature=0, extra_body=body)
    plain = client.chat.completions.create(model=MODEL, messages=CONTINUE, max_tokens=6,
                                           temperature=0, extra_body={**body, "echo": False})
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert message.content == prefix + plain.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=CONTINUE, max_tokens=6,
                                            temperature=0, stream=True, extra_body=body)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == message.content
    # Without a generation prompt the reply goes on as the last message's role; echo repeats it.
    user = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                          extra_body={"add_generation_prompt": False, "echo": True})
    assert user.choices[0].message.role == "user"
    assert user.choices[0].message.content.startswith(ASK[0]["content"])
    # With the generation prompt the last message is the user's: nothing to echo.
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                           extra_body={"echo": True})
    assert not reply.choices[0].message.content.startswith(ASK[0]["content"])


@pytest.mark.parametrize("body, param, message", [
    ({"continue_final_message": True}, "continue_final_message",
     "Cannot set both `continue_final_message` and `add_generation_prompt` to true"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "Cannot set both"),
    ({"chat_template_kwargs": {"enable_thinkng": False}}, "chat_template_kwargs",
     "does not read `enable_thinkng`"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "may not set `tokenize`"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "may not set `messages`"),
    ({"chat_template_kwargs": "yes"}, "chat_template_kwargs", "chat_template_kwargs"),
])
def test_bad_template_options_are_400s(client, body, param, message):
    e = bad_request(client.chat.completions.create, messages=CONTINUE, max_tokens=2,
                    extra_body=body)
    assert message in e.message and e.body["param"] == param, e.body


def test_return_token_ids_streamed(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert whole.choices[0].prompt_token_ids == ids and len(whole.choices[0].token_ids) == 5
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                            stream=True,
                                            extra_body={"return_token_ids": True,
                                                        "ignore_eos": True}))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    chat = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, stream=True,
                                               extra_body={"return_token_ids": True}))
    assert chat[0].prompt_token_ids == template_ids(tokenizer, ASK)


def test_streamed_token_ids_of_a_tool_call_equal_the_whole(client):
    """A streamed tool call's chunks carry token ids that join to the whole response's."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}}}
    kwargs = dict(model=MODEL, messages=ASK, tools=[tool], temperature=0, max_tokens=20,
                  tool_choice={"type": "function", "function": {"name": "pick"}},
                  extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks for choice in c.choices for t in (choice.token_ids or [])]
    assert streamed == whole.token_ids and len(streamed) > 0


# -- vLLM's guided_* names -----------------------------------------------------------------------
def test_guided_fields_map_onto_structured_outputs(server, client):
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["red", "green"], "guided_decoding_backend": "xgrammar"})
    assert choice.choices[0].message.content in ("red", "green")
    regex = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                      extra_body={"guided_regex": "[ab]{3}"})
    assert len(regex.choices[0].text) == 3 and set(regex.choices[0].text) <= {"a", "b"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for guided_json in (schema, json.dumps(schema)):
        reply = client.completions.create(
            model=MODEL, prompt="x", max_tokens=20, temperature=0,
            extra_body={"guided_json": guided_json,
                        "structured_outputs": None})   # null means "not set"
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply.choices[0].text)["n"], int)
    grammar = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                        extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert grammar.choices[0].text in ("yes", "no")
    client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                              extra_body={"guided_choice": ["a", "b"]})
    log = server.log_path.read_text()
    for name in ("guided_choice", "guided_regex", "guided_json", "guided_grammar",
                 "guided_decoding_backend"):
        assert log.count(f"`{name}` is deprecated") == 1, name


@pytest.mark.parametrize("body, param, message", [
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice",
     "set structured_outputs or the deprecated guided_choice, not both"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice",
     "set one of guided_json, guided_regex, guided_choice, guided_grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "set response_format or guided_regex, not both"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "this server's backend \"xgrammar\""),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "not supported"),
])
def test_bad_guided_requests_are_400s(client, body, param, message):
    e = bad_request(client.completions.create, prompt="x", max_tokens=2, extra_body=body)
    assert message in e.message and e.body["param"] == param, e.body


# -- no silent 200s ------------------------------------------------------------------------------
def test_openai_fields_without_effect_are_accepted(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK + [{"role": "assistant", "content": "Red.", "refusal": None},
                                     {"role": "user", "content": "Another?"}],
        max_tokens=2, user="u-1", metadata={"run": "7"}, store=False, service_tier="auto",
        parallel_tool_calls=False,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s", "modalities": ["text"],
                    "use_beam_search": False, "stream_options": None,
                    "vllm_xargs": {"speculative_decoding": False}})
    assert chat.choices[0].finish_reason in ("length", "stop")
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=2, user="u",
                                     extra_body={"spaces_between_special_tokens": False,
                                                 "add_special_tokens": False, "length_penalty": 1})
    assert done.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "x", "temprature": 0}, "temprature",
     "unknown field `temprature`"),
    ("/v1/completions", {"prompt": "x", "store": True}, "store", "unknown field `store`"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search",
     "`use_beam_search` is not supported by treadle (only null or false)"),
    ("/v1/completions", {"prompt": "x", "stream": True,
                         "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x", "unknown field `stream_options.x`"),
    ("/v1/completions", {"prompt": "x", "logits_processors": ["f"]}, "logits_processors",
     "not supported"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 (the model's context), an integer >= 1 or None, got 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "nmae": "a"}]},
     "messages.0.nmae", "unknown field `messages.0.nmae`"),
    ("/v1/chat/completions", {"messages": ASK, "functions": [{"name": "f"}]}, "functions",
     "`functions` is not supported"),
    ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "low"}, "reasoning_effort",
     "not supported"),
    ("/v1/chat/completions", {"messages": ASK, "include_reasoning": False}, "include_reasoning",
     "include_reasoning: false needs the server started with --reasoning-parser"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "paramters": {}}}]}, "tools.0.function.paramters", "unknown field"),
    ("/tokenize", {"prompt": "x", "add_bos": True}, "add_bos", "unknown field `add_bos`"),
])
def test_fields_treadle_would_ignore_are_400s_naming_them(server, path, body, param, message):
    status, reply = server.request("POST", path, {"model": MODEL, "max_tokens": 2, **body}
                                   if path != "/tokenize" else body)
    assert_error(status, reply, 400)
    assert message in reply["error"]["message"] and reply["error"]["param"] == param, reply



# -- cache_salt ----------------------------------------------------------------------------------
def test_cache_salt_keeps_tenants_prefix_caches_apart(client):
    """vLLM's cache_salt: a prompt cached under one salt is a miss under another, and a hit
    under the same; the text does not depend on it."""
    prompt = [(7 * i) % 500 + 3 for i in range(70)]   # four full blocks of 16

    def run(salt: str | None):
        extra = {"cache_salt": salt} if salt is not None else {}
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body=extra)
        return resp.choices[0].text, resp.usage.prompt_tokens_details.cached_tokens

    text, _ = run("alice")
    assert run("bob") == (text, 0)
    assert run(None) == (text, 0)
    assert run("alice") == (text, 64)
    error = bad_request(client.completions.create, prompt=prompt, max_tokens=1,
                        extra_body={"cache_salt": ""})
    assert error.body["param"] == "cache_salt"


def test_tokenize_takes_tools_as_chat_does_and_refuses_chat_options_on_a_prompt(server, client,
                                                                                tokenizer):
    tools = [{"type": "function", "function": {"name": "paint", "description": "Paint a wall.",
                                               "parameters": {"type": "object"}}}]
    resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, tools=tools,
                                          tool_choice="none", extra_body={"return_token_ids": True})
    status, body = server.request("POST", "/tokenize", {"messages": ASK, "tools": tools})
    expected = template_ids(tokenizer, ASK, tools=tools)
    assert "paint" in tokenizer.decode(expected)
    assert status == 200 and body["tokens"] == resp.prompt_token_ids == expected
    for name, value in (("chat_template_kwargs", {"enable_thinking": False}),
                        ("continue_final_message", True), ("tools", tools)):
        status, body = server.request("POST", "/tokenize", {"prompt": "x", name: value})
        assert (status, body["error"]["param"]) == (400, name), body


def test_weight_updates_refuse_unknown_fields(server):
    status, body = server.request("POST", "/update_weights_from_disk",
                                  {"path": "/nonexistent", "weight_versoin": "v2"})
    assert (status, body["error"]["param"]) == (400, "weight_versoin"), body


# -- prompt_logprobs -----------------------------------------------------------------------------
def close(got: float, want: float) -> bool:
    """fp32 logprobs from GEMMs summed in another order: a few ulps of logits of magnitude 40
    (a logprob of -36.4558 came back 1.4e-4 off on a Zen 5, the same on the last commit)."""
    return abs(got - want) < 1e-4 + 1e-5 * abs(want)


def test_prompt_logprobs_equal_transformers(client, model_path, reference):
    """vLLM's prompt_logprobs on both endpoints: each prompt token's logprob (transformers'),
    with the top N and ranks; none for the first token."""
    prompt = [(11 * i) % 700 + 5 for i in range(40)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                     extra_body={"prompt_logprobs": 2})
    lps = resp.choices[0].prompt_logprobs
    expected = reference(model_path).prompt_logprobs(prompt).tolist()
    assert lps[0] is None and len(lps) == len(prompt)
    for position, entry in enumerate(lps[1:], start=1):
        chosen = entry[str(prompt[position])]
        assert close(chosen["logprob"], expected[position - 1])
        top = sorted((e for e in entry.values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2] and top[0]["logprob"] >= top[1]["logprob"]
        assert len(entry) <= 3 and all(e["decoded_token"] is not None for e in entry.values())

    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0,
                                                      "return_token_ids": True})
    ids = chat.prompt_token_ids
    expected = reference(model_path).prompt_logprobs(ids).tolist()
    got = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], chat.prompt_logprobs[1:])]
    assert chat.prompt_logprobs[0] is None
    assert all(close(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("body", [{"stream": True, "prompt_logprobs": 1},
                                  {"echo": True, "logprobs": 1, "prompt_logprobs": 1}])
def test_prompt_logprobs_refused_where_they_cannot_be_returned(client, body):
    error = bad_request(client.completions.create, prompt="x", max_tokens=1, extra_body=body)
    assert error.body["param"] == "prompt_logprobs"


# -- logprobs of tokens that hold part of a character ---------------------------------------
# Byte-level BPE splits most CJK characters and emoji over two or three tokens, each of which
# decodes alone to U+FFFD. Their chat `bytes` were U+FFFD's, not the token's own (OpenAI's
# field is there to join such tokens back into characters); completions' `text_offset`
# counted each as one character and drifted (and streamed offsets differed from whole ones);
# and two such tokens shared a top_logprobs key, the sampled one's value overwritten.

def test_chat_logprob_bytes_of_a_partial_character(server, tokenizer):
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert len(ids) == 2                       # b"\xe6\x97" + b"\xa5"
    status, body = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0,
        "logprobs": True, "allowed_token_ids": [ids[0]]})
    assert status == 200, body
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == list("日".encode()[:2]), entry     # got [239, 191, 189] (U+FFFD)


def test_completion_text_offset_indexes_the_text(server, tokenizer):
    prompt = "日本語😀 ok"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0,
            "temperature": 0}
    status, whole = server.request("POST", "/v1/completions", body)
    assert status == 200, whole
    lp = whole["choices"][0]["logprobs"]
    text = whole["choices"][0]["text"]
    assert text == prompt
    i = lp["tokens"].index(" ok")
    assert text[lp["text_offset"][i]:].startswith(" ok"), (lp["text_offset"], text)   # offset 9, not 4


def test_completion_text_offset_streamed_equals_whole(server):
    body = {"model": MODEL, "prompt": "日本語😀 ok", "max_tokens": 4, "echo": True, "logprobs": 0,
            "temperature": 0}
    _, whole = server.request("POST", "/v1/completions", body)
    _, streamed = server.request("POST", "/v1/completions", {**body, "stream": True})
    events = [json.loads(e[6:]) for e in streamed.split("\n\n") if e.startswith("data: {")]
    offsets = [o for e in events if e["choices"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


def test_completion_top_logprobs_keep_the_sampled_tokens_value(server, tokenizer):
    first = tokenizer.encode("日", add_special_tokens=False)[0]
    status, body = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 1, "temperature": 0, "logprobs": 2,
        "allowed_token_ids": [first]})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0][lp["tokens"][0]] == lp["token_logprobs"][0], lp


@pytest.mark.parametrize("top", [-1, 21])
def test_a_chat_top_logprobs_out_of_range_is_named(server, top):
    """It was refused naming logprobs, a field the client sent right."""
    status, body = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "logprobs": True, "top_logprobs": top})
    assert status == 400 and body["error"]["param"] == "top_logprobs", body
    assert "top_logprobs must be in [0, 20]" in body["error"]["message"]
