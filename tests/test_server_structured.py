"""Structured outputs, tool calling and reasoning over HTTP: a real `treadle serve` of the
embedded SmolLM2-135M-Instruct, driven by the unmodified openai SDK (its streaming helper
assembles the tool-call deltas, so they must arrive as OpenAI sends them). The server splits
replies with the qwen3 reasoning parser, thinking off by default (its chat template, SmolLM2's
with Qwen3's enable_thinking switch, and --default-chat-template-kwargs); SmolLM2 does not
think, so a reply that does is forced with a choice constraint (which binds from the first
token, as the prompt has ended the reasoning), and its reasoning must come apart from its
answer, its tool calls and its logprobs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from treadle import LLM, SamplingParams
from treadle.entrypoints.openai.errors import OpenAIError
from treadle.entrypoints.openai.protocol import ChatCompletionRequest
from treadle.entrypoints.openai.tool_parsers import get_tool_parser
from treadle.entrypoints.openai.tools import ToolCalls, tool_call, tool_choice_of, tool_constraint
from treadle.models.loader import load_tokenizer, prepare_model

from tests.test_server import ENGINE_ARGS, MODEL, Server, assert_error

PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "required": ["zone"], "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING_OFF = ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def template(smollm2_path) -> str:
    """SmolLM2's, with Qwen3's switch: thinking off, the prompt ends the (empty) reasoning."""
    return load_tokenizer(prepare_model(smollm2_path)).chat_template + THINKING_OFF


@pytest.fixture(scope="module")
def server(smollm2_path, template, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "template.jinja").write_text(template)
    srv = Server(smollm2_path, folder, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "qwen3", "--chat-template", str(folder / "template.jinja"),
                 "--default-chat-template-kwargs", '{"enable_thinking": false}')
    yield srv
    # No block may be held by any request, whatever the tests sent.
    assert srv.request("POST", "/reset_prefix_cache")[0] == 200, srv.log()
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def offline(smollm2_path) -> LLM:
    return LLM(smollm2_path, **ENGINE_ARGS)


def test_json_schema_response_format_equals_offline(client, offline, template):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], temperature=0,
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert resp.choices[0].finish_reason == "stop"
    want = offline.chat([{"role": "user", "content": "Describe a person."}], SamplingParams(
        temperature=0, max_tokens=60, structured_outputs={"json": PERSON}), use_tqdm=False,
        chat_template=template, chat_template_kwargs={"enable_thinking": False})
    assert text == want[0].outputs[0].text


def test_json_object_and_vllm_structured_outputs_on_completions(client):
    resp = client.completions.create(model=MODEL, prompt="A JSON object about a cat:",
                                     max_tokens=80, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].text), dict)
    else:   # cut by max_tokens: still the start of an object
        assert resp.choices[0].text.lstrip().startswith("{")
    for constraint, check in [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
    ]:
        resp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, n=3,
                                         temperature=1.0, seed=5,
                                         extra_body={"structured_outputs": constraint})
        for choice in resp.choices:
            assert choice.finish_reason == "stop" and check(choice.text), (constraint, choice.text)


def test_streamed_constrained_chat(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}], stream=True,
        max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in ("red", "green", "blue") and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,message", [
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "Unsupported type"),
    ({"structured_outputs": {"regex": "a(b"}}, "Regex parsing error"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, 'Rule "nothing" is not defined'),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "not both"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}, "min_tokens must be 0"),
])
def test_bad_constraints_are_400s(server, body, message):
    for path, base in [("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": ASK})]:
        status, reply = server.request("POST", path, {"model": MODEL, **base, **body})
        assert_error(status, reply, 400)
        assert message in reply["error"]["message"], reply


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "guided_json": {"type": "objectx"}}, "guided_json"),
    ("/v1/completions", {"prompt": "Hi", "guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": "{"}, "guided_json"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": {"type": "objectx"}}},
     "structured_outputs"),
])
def test_a_bad_constraint_is_named_by_the_field_that_carried_it(server, path, body, param):
    """Not by structured_outputs, where the client sent a guided_* field, response_format or
    tools: each becomes a structured_outputs constraint inside."""
    status, reply = server.request("POST", path, {"model": MODEL, "max_tokens": 2, **body})
    assert_error(status, reply, 400)
    assert reply["error"]["param"] == param, reply
    assert param in reply["error"]["message"], reply
    if param != "structured_outputs":
        assert "structured_outputs" not in reply["error"]["message"], reply


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(client):
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=7, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "(ab)+c{20}"}})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7


@pytest.mark.parametrize("constraint", [
    {"regex": r"a[^\s\S]b"}, {"regex": r"[^\s\S]"},
    {"json": {"type": "string", "pattern": "^a[^\\s\\S]b$"}}], ids=["regex", "empty_regex", "json"])
def test_an_unsatisfiable_grammar_ends_only_its_own_request(server, client, constraint):
    """Once killed the server: a token outside an empty mask broke an assert in the engine."""
    status, reply = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 8, "structured_outputs": constraint})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "error"
    assert choice["stop_reason"].startswith("structured_outputs cannot be satisfied"), choice
    assert server.request("GET", "/health")[0] == 200, server.log()
    resp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=5, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].text in ("yes", "no")


def _arguments_of(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tool_choice_required(client):
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice="required", temperature=0, max_tokens=120)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice.message.tool_calls:
        _arguments_of(call, tools[call.function.name])


# Local $refs, as every pydantic model with a nested one writes them, and a recursive tool.
ROUTE = {"type": "function", "function": {"name": "plan_route", "parameters": {
    "type": "object", "required": ["stops"], "properties": {
        "stops": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/Stop"}}},
    "$defs": {"Stop": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 12}}}}}}}
TREE = {"type": "function", "function": {"name": "draw_tree", "parameters": {
    "type": "object", "required": ["label", "kids"], "properties": {
        "label": {"type": "string", "maxLength": 8},
        "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}}}}}


def test_tool_choice_required_keeps_each_tools_refs(client):
    """Each tool's parameters sat in the "required" wrapper's array, so their local $refs
    pointed into the wrapper: a $defs tool was a 400, and a recursive one was held to the
    wrapper's items as its own arguments (a helper's finds)."""
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[ROUTE],
                                          tool_choice="required", temperature=0, max_tokens=200,
                                          parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _arguments_of(choice.message.tool_calls[0], ROUTE)
    # A recursive tool's whole output may not fit a test's tokens; its constraint is checked.
    request = ChatCompletionRequest(messages=ASK, tools=[TREE], tool_choice="required")
    schema = tool_constraint(request, "required")["json"]
    args = {"label": "a", "kids": [{"label": "b", "kids": []}]}
    jsonschema.validate([{"name": "draw_tree", "parameters": args}], schema)
    wrapped = {"label": "a", "kids": [[{"name": "draw_tree", "parameters": args}]]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "draw_tree", "parameters": wrapped}], schema)


@pytest.mark.parametrize("choice, text", [
    ("required", '[\n\n{\n    "'),   # cut short before its first call
    ("required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_w'),
    ("required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'),
    ({"type": "function", "function": {"name": "get_time"}}, '{\n    "zone": "'),
    ({"type": "function", "function": {"name": "get_time"}}, '{"zone": "UTC"}')])
def test_a_forced_tool_call_streams_as_it_is_answered_whole(choice, text):
    """Cut short by max_tokens, a forced call was content whole, and streamed a call with the
    partial arguments (named) or nothing at all ("required"; a helper's find)."""
    request = ChatCompletionRequest(messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    content, calls = ToolCalls(tool_choice_of(request, None), None).extract(text)
    streamed = ToolCalls(tool_choice_of(request, None), None)
    parts = [streamed.feed(text[i:i + 7], finished=i + 7 >= len(text)) for i in range(0, len(text), 7)]
    names, arguments = {}, {}
    for _, deltas in parts:
        for delta in deltas:
            names[delta.index] = names.get(delta.index, "") + (delta.function.name or "")
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert "".join(c for c, _ in parts) == (content or "")
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(names[i], arguments[i]) for i in sorted(names)]


def test_tool_choice_required_streamed_equals_whole(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_named_tool_choice_whole_and_streamed(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    assert whole.message.tool_calls[0].function.name == "get_time"
    args = _arguments_of(whole.message.tool_calls[0], TIME)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == args


def test_tool_choice_auto_answers_plainly_as_content(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER],
        temperature=0, max_tokens=30)
    choice = resp.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_tool_results_go_back_through_the_template(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                          tool_choice="none", temperature=0, max_tokens=20)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(server, body, message):
    status, reply = server.request("POST", "/v1/chat/completions",
                                   {"model": MODEL, "messages": ASK, **body})
    assert_error(status, reply, 400)
    assert message in reply["error"]["message"], reply


def test_auto_needs_a_parser():
    req = ChatCompletionRequest(messages=ASK, tools=[WEATHER])
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        tool_choice_of(req, None)


# -- the hermes parser, whole and streamed -----------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text,content,calls", [
    ("Hello there.", "Hello there.", []),
    (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check. " + CALL + CALL.replace("Paris", "Rome"), "Let me check.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("Use <tool_c", "Use <tool_c", []),
    # The model wrote half a surrogate pair as a JSON escape: no response could carry the
    # character json.loads makes of it (a reviewer's find: 500s). Arguments keep the escape;
    # a name no tool has stays in the content.
    ('<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>', None,
     [("f", '{"a": "\\ud800"}')]),
    ('<tool_call>{"name": "f", "arguments": "x\\udc00"}</tool_call>', None, [("f", "x\\udc00")]),
    ('<tool_call>{"name": "\\ud800"}</tool_call>', '<tool_call>{"name": "\\ud800"}</tool_call>', []),
])
def test_hermes_parser(text, content, calls):
    parser = get_tool_parser("hermes")
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for call in got_calls:   # what a response carries
        json.loads(tool_call(call).model_dump_json())
    for step in (1, 3, 7):   # fed in pieces, the stream gives the same calls and text
        stream, streamed, text_out = parser.stream(), [], ""
        for i in range(0, len(text), step):
            piece, found = stream.feed(text[i:i + step])
            text_out, streamed = text_out + piece, streamed + found
        rest, found = stream.finish()
        text_out, streamed = text_out + rest, streamed + found
        assert [(c.name, c.arguments) for c in streamed] == calls
        assert text_out.strip() == (content or "")


THOUGHT = "<think>The user wants Paris. I should check.</think>"
CALL = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "</tool_call>")


def _forced(text: str, **kwargs) -> dict:
    return {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 0,
            "extra_body": {"structured_outputs": {"choice": [text]}, **kwargs.pop("extra", {})},
            **kwargs}


def test_reasoning_comes_apart_from_the_answer(client):
    whole = client.chat.completions.create(**_forced(THOUGHT + "Sunny.", logprobs=True))
    message = whole.choices[0].message
    assert message.content == "Sunny."
    assert message.reasoning == message.reasoning_content == "The user wants Paris. I should check."
    # Streamed: the reasoning deltas come first, then the answer's, whatever the token cuts;
    # tokens held back for a tag come with their logprobs.
    reasoning, content, logprobs = [], [], []
    for chunk in client.chat.completions.create(**_forced(THOUGHT + "Sunny.", logprobs=True),
                                                stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning", None) or "")
            content.append(choice.delta.content or "")
            assert (getattr(choice.delta, "reasoning_content", None) or "") == reasoning[-1]
            logprobs += choice.logprobs.content if choice.logprobs else []
    assert "".join(reasoning) == message.reasoning and "".join(content) == "Sunny."
    assert max(i for i, r in enumerate(reasoning) if r) < min(i for i, c in enumerate(content) if c)
    assert [(lp.token, lp.logprob) for lp in logprobs] == [
        (lp.token, lp.logprob) for lp in whole.choices[0].logprobs.content]
    assert len(logprobs) == whole.usage.completion_tokens
    # include_reasoning: false leaves it out; a reply that does not open with <think> is all answer.
    quiet = client.chat.completions.create(**_forced(THOUGHT + "Sunny.", extra={"include_reasoning": False}))
    assert quiet.choices[0].message.content == "Sunny." and quiet.choices[0].message.reasoning is None
    plain = client.chat.completions.create(**_forced("Sunny, I think.</think>")).choices[0].message
    assert plain.content == "Sunny, I think.</think>" and plain.reasoning is None


def test_enable_thinking_switches_the_reasoning_on(client, offline):
    """With thinking on (qwen3's default, turned off by this server's default variables), a
    reply is reasoning from its first token, up to a </think> this model never writes; a
    grammar waits for that </think>, so a constrained reply reasons freely, token for token."""
    ask = {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0}
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    off = client.chat.completions.create(**ask).choices[0].message
    on = client.chat.completions.create(**ask, extra_body=thinking).choices[0].message
    assert off.reasoning is None and off.content
    tokenizer = offline.get_tokenizer()
    prompt = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    free = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert on.content is None and on.reasoning == free[0].outputs[0].text
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    waiting = client.chat.completions.create(**ask, extra_body=thinking, response_format=schema)
    assert waiting.choices[0].message.reasoning == on.reasoning
    assert waiting.choices[0].message.content is None
    # A named tool's grammar waits too: no call, whole or streamed, from a thought cut short.
    named = dict(ask, extra_body=thinking, tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**named).choices[0]
    assert whole.message.reasoning == on.reasoning and not whole.message.tool_calls
    assert whole.finish_reason == "length"
    chunks = [c for chunk in client.chat.completions.create(**named, stream=True)
              for c in chunk.choices]
    assert not any(c.delta.tool_calls for c in chunks)
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == on.reasoning
    assert chunks[-1].finish_reason == "length"
    # vllm_xargs {"reasoning": true} says the reply starts inside the reasoning, thinking off
    # or not: the grammar waits, and the text is reasoning.
    told = client.chat.completions.create(**ask, response_format=schema,
                                          extra_body={"vllm_xargs": {"reasoning": True}})
    assert told.choices[0].message.reasoning == off.content
    assert told.choices[0].message.content is None
    # Thinking off, the prompt has ended the reasoning: the grammar binds from the first token.
    bound = client.chat.completions.create(**{**ask, "max_tokens": 60}, response_format=schema)
    jsonschema.validate(json.loads(bound.choices[0].message.content), PERSON)


def test_tool_calls_are_found_past_the_reasoning(client):
    for stream in (False, True):
        resp = client.chat.completions.create(**_forced(THOUGHT + CALL, tools=[WEATHER], stream=stream))
        if stream:   # the SDK's own assembly of the deltas
            reasoning, calls, content = "", {}, ""
            for chunk in resp:
                for choice in chunk.choices:
                    reasoning += getattr(choice.delta, "reasoning", None) or ""
                    content += choice.delta.content or ""
                    for call in choice.delta.tool_calls or []:
                        calls.setdefault(call.index, call.function)
        else:
            message = resp.choices[0].message
            assert resp.choices[0].finish_reason == "tool_calls" and message.content is None
            reasoning, calls, content = message.reasoning, dict(enumerate(message.tool_calls)), ""
            calls = {k: c.function for k, c in calls.items()}
        assert reasoning == "The user wants Paris. I should check." and content == ""
        assert [(c.name, json.loads(c.arguments)) for c in calls.values()] == [
            ("get_weather", {"city": "Paris", "unit": "celsius"})]

