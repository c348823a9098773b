"""`treadle serve` shows its start-up stages on stderr as they happen, by default; and the KV
cache it allocates on CPU is what the requests can use, said in one line with the reason."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from treadle import config as config_module
from treadle.config import EngineArgs, num_blocks_from_budget
from treadle.entrypoints.cli import build_parser
from treadle.entrypoints.engine_cli_args import engine_args_from

# Each stage's line, in the order they must come.
STAGES = ["start-up: imports in", "start-up: model files in", "loading the engine",
          "engine config in",
          "read the weights in", "loaded ", "KV cache: 65 blocks of 16 tokens",
          "allocated 65 KV blocks in", "the engine core process: froze", "start-up: engine in",
          "the server: froze",
          "start-up: garbage collector in", "listening on", "ready to serve"]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


def test_serve_logs_each_stage_to_stderr_in_order(llama):
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle.entrypoints.cli", "serve", llama, "--port", "0",
         "--max-model-len", "256", "--block-size", "16", "--max-num-seqs", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("ready to serve" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    positions = []
    for stage in STAGES:
        found = [i for i, line in enumerate(lines) if stage in line]
        assert found, (stage, "".join(lines))
        positions.append(found[0])
    assert positions == sorted(positions), "".join(lines)
    kv_line = lines[positions[STAGES.index("KV cache: 65 blocks of 16 tokens")]]
    assert "(max_num_seqs 4 x max_model_len 256)" in kv_line, kv_line


@pytest.fixture
def config(llama):
    """The tiny Llama's config with a CPU cache sized by default: 4 requests of 256 tokens."""
    return EngineArgs(model=llama, device="cpu", max_model_len=256, block_size=16,
                      max_num_seqs=4).create_config()


def test_the_default_cpu_cache_holds_what_the_requests_can_use(config, caplog):
    with caplog.at_level(logging.INFO, logger="treadle.config"):
        assert num_blocks_from_budget(config) == 4 * 256 // 16 + 1   # and the null block
    per_block = config.cache.bytes_per_block(config.model)
    assert (f"KV cache: 65 blocks of 16 tokens, {65 * per_block / 2**20:.1f} MiB "
            "(max_num_seqs 4 x max_model_len 256)") in caplog.text


def test_memory_and_the_cap_bound_the_default(config, monkeypatch, caplog):
    per_block = config.cache.bytes_per_block(config.model)
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 40 * per_block)
    with caplog.at_level(logging.INFO, logger="treadle.config"):
        assert num_blocks_from_budget(config) == 10
        assert "(25% of " in caplog.text and "GiB available)" in caplog.text
        monkeypatch.setattr(config_module, "CPU_KV_CACHE_MAX_BYTES", 7 * per_block)
        assert num_blocks_from_budget(config) == 7
        assert "MiB default cap)" in caplog.text


def test_kv_cache_memory_bytes_overrides_the_default(llama, caplog):
    ns = build_parser().parse_args(["serve", llama, "--max-model-len", "256", "--block-size",
                                    "16", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
                                    "3000000"])
    args = {**engine_args_from(ns), "model": llama, "device": "cpu"}
    config = EngineArgs(**args).create_config()
    per_block = config.cache.bytes_per_block(config.model)
    with caplog.at_level(logging.INFO, logger="treadle.config"):
        assert num_blocks_from_budget(config) == 3_000_000 // per_block != 65
    assert "(kv_cache_memory_bytes=3000000)" in caplog.text
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes must be an integer >= 1, got 0"):
        EngineArgs(**{**args, "kv_cache_memory_bytes": 0}).create_config()
