"""What a server refuses, and how: bodies over --max-request-body-bytes (413, before they are
read), a prompt plus max_tokens past max_model_len (400 with the numbers, as vLLM); and a long
prompt, tokenized off the event loop (by the server, and by AsyncLLM for a text prompt), does
not stall /health meanwhile.

A real `treadle serve` of the tiny Llama (max_model_len 256), driven by the openai SDK, and by
raw HTTP where the SDK cannot send what is tested (a chunked body, a body never sent).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import openai
import pytest

from tests.test_server import ERROR_KEYS, MODEL, Server, assert_error
from treadle import AsyncLLM, SamplingParams

LIMIT = 6_000_000   # bytes; the long prompt below is 4 MB
# Long enough that tokenizing it takes well over a second: 2 MB took 0.8-1.0 s on a quiet Zen 5.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * (4_000_000 // 45)
CONTEXT = 256       # test_server's --max-model-len


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    srv = Server(tiny_checkpoints["llama"], tmp_path_factory.mktemp("limits"),
                 "--max-request-body-bytes", str(LIMIT))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def test_health_answers_while_a_long_prompt_is_tokenized(server):
    done: dict = {}

    def send() -> None:
        start = time.monotonic()
        done["status"], done["body"] = server.request(
            "POST", "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1})
        done["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.monotonic()
        assert server.request("GET", "/health")[0] == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.02)
    sender.join()
    assert_error(done["status"], done["body"], 400)
    assert "max_model_len" in done["body"]["error"]["message"]
    # Tokenizing 4 MB takes seconds; on the event loop, one /health would wait for all of it.
    assert done["seconds"] > 1.0, done
    assert len(waits) >= 10 and max(waits) < done["seconds"] / 3, (max(waits), done["seconds"])


def test_async_llm_tokenizes_a_long_text_off_the_event_loop(tiny_checkpoints):
    engine = AsyncLLM(tiny_checkpoints["llama"], max_model_len=CONTEXT, block_size=16,
                      num_kv_blocks=24)

    async def tokenize_long_prompt() -> tuple[float, list[float]]:
        loop = asyncio.get_running_loop()
        first = anext(engine.generate(LONG_PROMPT, SamplingParams(max_tokens=1), "long"))
        task = asyncio.ensure_future(first)
        start = last = loop.time()
        gaps = []
        while not task.done():
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last)
            last = loop.time()
        with pytest.raises(ValueError, match="max_model_len"):
            task.result()
        return last - start, gaps

    try:
        seconds, gaps = asyncio.run(tokenize_long_prompt())
    finally:
        engine.shutdown()
    assert seconds > 1.0 and max(gaps) < seconds / 3, (max(gaps), seconds)


def test_a_body_over_the_limit_is_413(server, client):
    message = f"over this server's limit of {LIMIT} bytes (treadle serve --max-request-body-bytes)"
    # Declared by Content-Length, through the SDK.
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="x" * LIMIT, max_tokens=1)
    assert e.value.status_code == 413
    assert set(e.value.body) == ERROR_KEYS and e.value.body["code"] == 413
    assert message in e.value.body["message"]

    # Refused on the headers alone: this body is never sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 10000000000\r\n\r\n")
        reply = s.makefile("rb")
        assert reply.readline().startswith(b"HTTP/1.1 413")
        headers = [line.decode().lower() for line in iter(reply.readline, b"\r\n")]
        length = next(int(h.split(":")[1]) for h in headers if h.startswith("content-length:"))
        body = json.loads(reply.read(length))
    assert body["error"]["code"] == 413 and message in body["error"]["message"]

    # Chunked, with no length up front: cut off once past the limit; under it, served.
    over = json.dumps({"model": MODEL, "prompt": "x" * LIMIT, "max_tokens": 1}).encode()
    status, body = chunked(server, over)
    assert_error(status, body, 413)
    assert message in body["error"]["message"]
    under = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    status, body = chunked(server, under)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def chunked(server: Server, data: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        parts = (data[i:i + 65536] for i in range(0, len(data), 65536))
        conn.request("POST", "/v1/completions", body=parts, encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_past_the_context_is_a_400_with_the_numbers(server, client):
    def refused(create, prompt_tokens: int, max_tokens: int, field: str = "max_tokens") -> None:
        with pytest.raises(openai.BadRequestError) as e:
            create(max_tokens)
        text = e.value.body["message"]
        assert e.value.body["param"] == field, e.value.body
        assert (f"maximum context length is {CONTEXT} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion)") in text, text
        assert f"{field} must be in [1, {CONTEXT - prompt_tokens}]" in text, text

    ids = list(range(1000, 1200))

    def complete(max_tokens: int):
        return client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens)

    def chat(**kwargs):
        return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)

    refused(complete, 200, 10**12)
    refused(complete, 200, 2**63 - 1)
    refused(complete, 200, 57)
    assert complete(56).usage.total_tokens <= CONTEXT

    messages = [{"role": "user", "content": "Hello"}]
    prompt_tokens = chat(max_tokens=1).usage.prompt_tokens
    refused(lambda m: chat(max_tokens=m), prompt_tokens, 10**12)
    # The field the client sent, by its name.
    refused(lambda m: chat(max_completion_tokens=m), prompt_tokens, 1000, "max_completion_tokens")
    # Past int64, or as a float: a 400 all the same, never a 500.
    for raw in (b'{"prompt": "x", "max_tokens": 9223372036854775808}',
                b'{"prompt": "x", "max_tokens": 1e12}'):
        assert_error(*server.request("POST", "/v1/completions", raw=raw), 400)

    # No max_tokens: the room left in the context.
    reply = chat(temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.total_tokens == CONTEXT
