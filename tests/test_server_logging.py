"""`treadle serve` logs its per-request lines (the request, a client that disconnects, the abort
that follows) at INFO only with --enable-log-requests: an lm-eval run sends hundreds of
requests. It always logs one line when it is ready, with the start-up time by phase."""

from __future__ import annotations

import re
import time

import openai
import pytest

from tests.test_server import MODEL, Server, scrape

READY = re.compile(r"ready to serve tiny-llama, [\d.]+ s after the process started: imports [\d.]+ s, "
                   r"model files [\d.]+ s, engine [\d.]+ s, garbage collector [\d.]+ s, "
                   r"HTTP server [\d.]+ s")
REQUEST_LINES = ("prompts=", "client disconnected", "aborting 1 unfinished prompt(s)")


def wait_for_aborts(server: Server, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while scrape(server).get(("treadle:request_success_total", ("abort",)), 0) < count:
        assert time.monotonic() < deadline, "the server did not abort the abandoned request"
        time.sleep(0.05)


@pytest.mark.parametrize("enabled", [False, True], ids=["default", "enable-log-requests"])
def test_request_lines_only_with_enable_log_requests(tiny_checkpoints, tmp_path, enabled):
    flags = ["--max-log-len", "6"] + (["--enable-log-requests"] if enabled else [])
    srv = Server(tiny_checkpoints["llama"], tmp_path, *flags)
    try:
        reply = srv.client().completions.create(model=MODEL, prompt="Confidential text",
                                                max_tokens=2)
        assert reply.usage.completion_tokens >= 1
        # A client gives up on a request the paused engine holds back; the server aborts it.
        assert srv.request("POST", "/pause?mode=keep")[0] == 200
        with pytest.raises(openai.APITimeoutError):
            srv.client().with_options(timeout=0.5).completions.create(
                model=MODEL, prompt="Patience", max_tokens=2)
        wait_for_aborts(srv, 1)
        assert srv.request("POST", "/resume")[0] == 200
    finally:
        assert srv.stop() == 0, srv.log()
    log = srv.log_path.read_text()   # whole, once the server has exited
    assert READY.search(log), log
    assert "POST /v1/completions" in log   # uvicorn's access log is unaffected
    for line in REQUEST_LINES:
        assert (line in log) == enabled, (line, log)
    assert "Confidential" not in log
    if enabled:
        assert "prompts=['Confid']" in log
