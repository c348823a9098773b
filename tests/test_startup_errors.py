"""`treadle serve` refuses a bad start-up in one clear line on stderr and a non-zero exit: no
traceback, and no engine loaded first when the problem is known before."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from treadle.config import EngineArgs

TREADLE = str(Path(sys.executable).parent / "treadle")


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 90
          ) -> tuple[subprocess.CompletedProcess, float]:
    """`treadle serve ARGS` to its end, and the seconds it took."""
    start = time.monotonic()
    out = subprocess.run([TREADLE, "serve", *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return out, time.monotonic() - start


def assert_clear_error(out: subprocess.CompletedProcess, *phrases: str) -> None:
    assert out.returncode != 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) < 5, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, out.stderr
    for phrase in phrases:
        assert phrase in errors[0], out.stderr


def test_port_out_of_range():
    out, _ = serve("--port", "70000")
    assert_clear_error(out, "--port", "0..65535", "70000")


def test_port_in_use_fails_before_the_engine_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out, seconds = serve("--port", str(port))   # the embedded model: seconds to load
    assert_clear_error(out, f"127.0.0.1:{port}", "in use")
    assert "loading the engine" not in out.stderr
    # As long as printing the help (the imports), give or take, not as long as a model load.
    help_start = time.monotonic()
    assert subprocess.run([TREADLE, "serve", "--help"], capture_output=True).returncode == 0
    assert seconds < (time.monotonic() - help_start) + 5, seconds


def test_cuda_on_a_machine_without_it(llama):
    out, _ = serve(llama, "--port", "0", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert_clear_error(out, "device 'cuda'", "CUDA is not available")


def test_max_model_len_past_the_model_needs_the_override(llama, monkeypatch):
    out, _ = serve(llama, "--port", "0", "--max-model-len", "2048")
    assert_clear_error(out, "max_model_len (2048)", "max_position_embeddings (1024)",
                       "TREADLE_ALLOW_LONG_MAX_MODEL_LEN=1")
    monkeypatch.setenv("TREADLE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert EngineArgs(model=llama, max_model_len=2048).create_config().model.max_model_len == 2048


def test_max_model_len_past_the_kv_cache(llama):
    out, _ = serve(llama, "--port", "0", "--max-model-len", "512", "--num-kv-blocks", "4",
                   "--block-size", "16")
    assert_clear_error(out, "max_model_len (512)", "KV cache can hold (48 tokens",
                       "num_kv_blocks")


def test_a_chat_template_that_is_neither_a_file_nor_a_template_fails_before_the_engine_loads():
    out, _ = serve("--port", "0", "--chat-template", "templates/missing.jinja")
    assert_clear_error(out, "--chat-template", "'templates/missing.jinja' is neither a file nor a template")
    assert "loading the engine" not in out.stderr
    out, _ = serve("--port", "0", "--default-chat-template-kwargs", "[1]")
    assert_clear_error(out, "--default-chat-template-kwargs must be a JSON object")
