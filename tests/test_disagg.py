"""Prefill/decode disaggregation over HTTP: a producer `treadle serve`, a consumer `treadle
serve` and `treadle disagg-proxy` in front, all real processes on 127.0.0.1, driven with the
openai SDK."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.test_server import MODEL, Server, scrape
from tests.test_correctness import TEXTS


class Proxy:
    def __init__(self, prefill: Server, decode: Server, log_dir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = log_dir / "proxy.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "treadle.entrypoints.cli", "disagg-proxy",
                 "--prefill", f"http://127.0.0.1:{prefill.port}",
                 "--decode", f"http://127.0.0.1:{decode.port}", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None, self.log_path.read_text()
                time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                             max_retries=0, timeout=60)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    llama = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("pd")
    store = str(root / "kv")

    def kv(role: str) -> str:
        return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shared_storage_path": store}})

    prefill = Server(llama, root, "--block-size", "16", "--kv-transfer-config", kv("kv_producer"))
    decode = Server(llama, root, "--block-size", "16", "--kv-transfer-config", kv("kv_consumer"),
                    "--enable-log-requests", "--max-model-len", "1024", "--num-kv-blocks", "80")
    proxy = Proxy(prefill, decode, root)
    yield prefill, decode, proxy
    proxy.stop()
    for server in (prefill, decode):
        if server.proc.poll() is None:
            server.stop()


PROMPT = TEXTS[3] + " " + TEXTS[0]   # 48 tokens: two whole blocks travel


def test_proxy_output_equals_a_single_server_streamed_and_not(pd):
    prefill, decode, proxy = pd
    single = prefill.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                                 temperature=0)
    via_proxy = proxy.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                                  temperature=0)
    assert via_proxy.choices[0].text == single.choices[0].text
    assert via_proxy.usage.completion_tokens == 16
    # The prefill answer carried kv_transfer_params, and the proxy handed them to the decode
    # server (which logs each request's sampling parameters).
    prefilled = prefill.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert prefilled.model_extra["kv_transfer_params"]["num_stored_blocks"] == 3
    assert "'kv_transfer_params': {'shared_storage_path'" in decode.log()
    # The decode server loaded the prompt's whole blocks (all but the last token's) instead
    # of computing them.
    usage = via_proxy.usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16 > 0
    streamed = "".join(c.choices[0].text for c in proxy.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == single.choices[0].text

    messages = [{"role": "user", "content": PROMPT}]
    chat_single = prefill.client().chat.completions.create(model=MODEL, messages=messages,
                                                           max_tokens=12, temperature=0)
    chat_proxy = proxy.client().chat.completions.create(model=MODEL, messages=messages,
                                                        max_tokens=12, temperature=0)
    assert chat_proxy.choices[0].message.content == chat_single.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in proxy.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == chat_single.choices[0].message.content


def post(port: int, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_what_a_server_takes_the_proxy_takes(pd):
    """min_tokens stayed in the one-token prefill request, past its max_tokens (a 400); a body
    that is not a JSON object was a 500 (a helper's finds)."""
    prefill, decode, proxy = pd
    single = prefill.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                 temperature=0, extra_body={"min_tokens": 6})
    via_proxy = proxy.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                  temperature=0, extra_body={"min_tokens": 6})
    assert via_proxy.choices[0].text == single.choices[0].text
    chat = proxy.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=8,
        temperature=0, extra_body={"min_tokens": 6})
    assert chat.usage.completion_tokens >= 6
    for body in (b"{not json", b"[1, 2]"):
        assert post(decode.port, body)[0] == 400
        status, answer = post(proxy.port, body)
        assert status == 400 and answer["error"]["type"] == "BadRequestError", answer


def test_a_client_gone_before_its_answer_aborts_the_decode_request(pd):
    prefill, decode, proxy = pd
    def aborted() -> float:
        return scrape(decode).get(("treadle:request_success_total", ("abort",)), 0.0)

    before = aborted()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True,
         "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while not scrape(decode).get(("treadle:num_requests_running", ()), 0):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.sock.close()   # the client goes away without reading its answer
    conn.close()
    deadline = time.monotonic() + 30
    while aborted() == before:   # the decode server ends it as "abort", not at its length
        assert time.monotonic() < deadline, "the decode server generated on for a gone client"
        time.sleep(0.05)


def test_decode_server_killed_mid_stream_ends_the_stream_with_an_error(pd):
    prefill, decode, proxy = pd
    stream = proxy.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=200,
                                               temperature=0, stream=True)
    start = time.monotonic()
    with pytest.raises((openai.APIError, openai.APIConnectionError)):
        for i, _ in enumerate(stream):
            if i == 2:
                os.kill(decode.proc.pid, signal.SIGKILL)
    assert time.monotonic() - start < 30
    decode.proc.wait(10)
    # With the decode server gone, the proxy answers 503 with a clear error body.
    with pytest.raises(openai.APIStatusError) as err:
        proxy.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert err.value.status_code == 503
    assert "unreachable" in err.value.body["message"]
