"""The `treadle` console script, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TREADLE = str(Path(sys.executable).parent / "treadle")


def run(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([TREADLE, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TQDM_DISABLE": "1"})


def test_help_reads_well():
    top = run("--help")
    assert top.returncode == 0
    for command in ("generate", "chat", "bench"):
        assert command in top.stdout
    gen = run("generate", "--help")
    assert gen.returncode == 0
    for flag in ("--model", "--max-tokens", "--temperature", "--max-num-seqs",
                 "--max-num-batched-tokens", "--num-kv-blocks", "--stop"):
        assert flag in gen.stdout


def test_generate_with_the_embedded_model():
    out = run("generate", "What is the capital of France?", "--max-tokens", "16", "-q")
    assert out.returncode == 0, out.stderr
    assert "### What is the capital of France?" in out.stdout
    assert "Paris" in out.stdout
    assert "finish_reason=" in out.stdout


def test_chat_repl_answers_and_exits():
    """The model as `treadle serve` takes it, positionally (the embedded one, named)."""
    from treadle.models.loader import default_model_path

    out = run("chat", default_model_path(), "--max-tokens", "16",
              stdin="What is the capital of France?\n/reset\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_vllms_boolean_flags_take_both_spellings():
    from treadle.entrypoints.cli import build_parser

    parser = build_parser()
    for flags, want in (([], True), (["--enable-prefix-caching"], True),
                        (["--no-enable-prefix-caching"], False)):
        ns = parser.parse_args(["serve", *flags, "--no-enable-chunked-prefill"])
        assert (ns.enable_prefix_caching, ns.enable_chunked_prefill) == (want, False)
    assert parser.parse_args(["generate", "x", "--enable-chunked-prefill"]).enable_chunked_prefill
    # Unset, async scheduling follows the device (on for CUDA): config.py's _async_scheduling.
    assert [parser.parse_args(["serve", *flags]).async_scheduling for flags in
            ([], ["--async-scheduling"], ["--no-async-scheduling"])] == [None, True, False]


def test_bad_flag_value_is_a_clear_error():
    out = run("generate", "hi", "--temperature", "-1", "-q")
    assert out.returncode == 2
    assert "temperature" in out.stderr and "Traceback" not in out.stderr
