"""Bodies that broke the server's rule (nothing a client sends may crash the engine, leak a
KV block or be a 500; a bad value is a 400 naming the field), found by fuzzing a real `treadle
serve` of the tiny Llama with raw HTTP, as the bodies are not what the SDK sends:

- `vllm_xargs.kv_transfer_params` that is not an object: with no KV connector the request's
  params are echoed in the response, whose model wants a dict (a 500 after the request ran).
- Nesting deeper than pydantic-core serializes (255 levels): `kv_transfer_params` echoed back,
  and `weight_version`, which every later response carries: one update made every completion,
  chat and GET /weight_version a 500 until the next update.
- Nesting deep enough for Python's recursion limit (tools' parameters and replayed tool-call
  arguments through the chat template, a JSON schema sent as text, any field ~960 deep through
  the body's Unicode check): a RecursionError, a 500. Bodies now nest at most 128 deep.
- A chat `max_completion_tokens` past the context: the 400 named `max_tokens`, not sent.
- One JSON schema for many prompts, parsed on the event loop once per prompt: /health waited.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.test_server import ERROR_KEYS, Server, wait_until_no_block_is_used

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    srv = Server(llama, tmp_path_factory.mktemp("hostile_input"))
    yield srv
    assert srv.stop() == 0, srv.log()


def nested(depth: int) -> str:
    """JSON text of `depth` objects, one inside the other."""
    return '{"a": ' * depth + "1" + "}" * depth


def assert_400(status, body, field: str) -> None:
    assert status == 400, (status, body)
    assert set(body["error"]) == ERROR_KEYS, body
    assert field in body["error"]["message"] or body["error"]["param"] == field, body


def test_vllm_xargs_kv_transfer_params_not_an_object_is_a_400(server):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})):
        for value in (5, "abc", True):
            status, answer = server.request("POST", path, {**body,
                                                           "vllm_xargs": {"kv_transfer_params": value}})
            assert_400(status, answer, "kv_transfer_params")
            assert answer["error"]["param"] == "kv_transfer_params", answer
    assert server.request("GET", "/health")[0] == 200
    wait_until_no_block_is_used(server)


def test_kv_transfer_params_nested_past_what_a_response_serializes_is_a_400(server):
    for path, body in (("/v1/completions", b'{"prompt": "x", "max_tokens": 2, '),
                       ("/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ')):
        status, answer = server.request(
            "POST", path, raw=body + b'"kv_transfer_params": ' + nested(300).encode() + b"}")
        assert_400(status, answer, "kv_transfer_params")
    wait_until_no_block_is_used(server)


def test_a_deeply_nested_weight_version_is_refused_and_breaks_no_later_response(server, llama):
    try:
        status, body = server.request("POST", "/update_weights_from_disk", raw=(
            b'{"path": %s, "weight_version": %s}' % (json.dumps(llama).encode(),
                                                     nested(300).encode())))
        assert_400(status, body, "weight_version")
        assert server.request("GET", "/weight_version")[0] == 200
        status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200, body
        status, body = server.request("POST", "/v1/chat/completions",
                                      {"messages": CHAT, "max_tokens": 2})
        assert status == 200, body
        status, text = server.request("POST", "/v1/completions",
                                      {"prompt": "x", "max_tokens": 2, "stream": True})
        assert status == 200 and '"error"' not in text, text
    finally:   # a label that breaks responses must not outlive this test
        server.request("POST", "/update_weights_from_disk", {"path": llama, "weight_version": None})


def test_deep_tool_parameters_and_tool_call_arguments_are_a_400(server):
    deep = "[" * 600 + "]" * 600
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "DEEP"}}}]
    tools_json = json.dumps(tools).replace('"DEEP"', deep)
    for path, raw in (
            ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "tools": %s, '
                                     '"tool_choice": "none"}' % (json.dumps(CHAT), tools_json)),
            ("/tokenize", '{"messages": %s, "tools": %s}' % (json.dumps(CHAT), tools_json))):
        status, body = server.request("POST", path, raw=raw.encode())
        assert_400(status, body, "tools")
    messages = [{"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                {"role": "user", "content": "x"}]
    status, body = server.request("POST", "/v1/chat/completions",
                                  {"messages": messages, "max_tokens": 2})
    assert_400(status, body, "messages")
    wait_until_no_block_is_used(server)


def test_a_json_schema_sent_as_text_nested_past_the_recursion_limit_is_a_400(server):
    schema = "[" * 960 + "]" * 960
    status, body = server.request("POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}})
    assert_400(status, body, "structured_outputs")


def test_any_field_nested_960_deep_is_a_400(server):
    for depth in (958, 960, 962, 964):
        deep = "[" * depth + "]" * depth
        status, body = server.request("POST", "/v1/completions", raw=(
            '{"prompt": "x", "max_tokens": 2, "documents": %s}' % deep).encode())
        assert status == 400 and set(body["error"]) == ERROR_KEYS, (depth, status, body)
    assert server.request("GET", "/health")[0] == 200


def test_chat_max_completion_tokens_past_the_context_names_that_field(server):
    status, body = server.request("POST", "/v1/chat/completions", {
        "messages": CHAT, "max_completion_tokens": 10**6})
    assert status == 400, body
    assert "max_completion_tokens" in body["error"]["message"], body
    assert body["error"]["param"] == "max_completion_tokens", body


def test_one_schema_for_many_prompts_does_not_stall_the_event_loop(server):
    """The grammar was checked (xgrammar's from_json_schema) on the event loop, once per prompt
    and again per prompt in make_requests: 600 prompts sharing a schema 60 objects deep (a 5 KB
    body) held /health for 37 s."""
    depth = 60
    schema = json.loads('{"type": "object", "properties": {"e": ' * depth + '{"type": "object"}'
                        + "}}" * depth)
    worst, done = [0.0], threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert server.request("GET", "/health")[0] == 200
            worst[0] = max(worst[0], time.monotonic() - start)
            time.sleep(0.1)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        status, body = server.request("POST", "/v1/completions", {
            "prompt": ["x"] * 300, "max_tokens": 1, "structured_outputs": {"json": schema}})
    finally:
        done.set()
        thread.join(120)
    assert status == 200, body
    assert worst[0] < 3.0, f"/health waited {worst[0]:.1f} s"
    wait_until_no_block_is_used(server)
