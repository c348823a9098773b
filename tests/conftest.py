"""Shared fixtures: the embedded model, tiny checkpoints, and the transformers reference."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from hypothesis import settings

from tests.gpu import GPU_KV_BYTES
from tests.reference import HFReference
from tests.tiny_models import make_tiny_checkpoint
from treadle.models.loader import default_model_path, iter_hf_weights

# Property tests: "ci" by default; `pytest --hypothesis-profile=long` for the deep run.
settings.register_profile("ci", max_examples=500, deadline=None)
settings.register_profile("long", max_examples=10_000, deadline=None)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _no_grammar_compile_outlives_its_test():
    """A compile a test abandoned (its request aborted or timed out) runs on, as it cannot be
    stopped: wait for it, so that its core and memory do not reach the next test's figures."""
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("treadle-grammar-") and not thread.daemon:
            thread.join(timeout=120)


# The only skips a run may have, by reason. Any other skip fails the run: a test that cannot
# run here (a missing compiler, library or program) must not pass unnoticed.
NEEDS_GPU = "needs a CUDA device"
EXPECTED_SKIPS = (NEEDS_GPU,)
_skips: list[tuple[str, str]] = []   # (test id, reason)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason=NEEDS_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _skips.append((report.nodeid, report.longrepr[2].removeprefix("Skipped: ")))


def _unexpected_skips() -> list[tuple[str, str]]:
    return [(test, reason) for test, reason in _skips if reason not in EXPECTED_SKIPS]


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips() and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unexpected = _unexpected_skips()
    terminalreporter.write_line(f"skips: {len(_skips)} ({len(_skips) - len(unexpected)} expected: "
                                f"{', '.join(EXPECTED_SKIPS)})")
    for test, reason in unexpected:
        terminalreporter.write_line(f"UNEXPECTED SKIP (fails the run): {test}: {reason}", red=True)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama(tiny_checkpoints) -> str:
    """The tiny Llama's folder (1024 positions); no test writes to it."""
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def original_weights(llama) -> dict[str, torch.Tensor]:
    """The tiny Llama's weights by transformers name, a fresh copy for each module."""
    return dict(iter_hf_weights(llama))


@functools.lru_cache(maxsize=None)
def _reference(path: str) -> HFReference:
    return HFReference(path)


@pytest.fixture(scope="session")
def reference():
    """reference(path) -> HFReference for that model, built once per session."""
    return _reference


# Engine arguments per device, for a test that runs on the CPU and, marked gpu, on CUDA too (it
# takes the `on_device` fixture). On CUDA: the triton kernels in fp32, exact against
# transformers, and a KV cache of a fixed size (tests/gpu.py says why).
ENGINE_ARGS_ON = {
    "cpu": {},
    "cuda": {"device": "cuda", "attention_backend": "triton", "dtype": "float32",
             "kv_cache_memory_bytes": GPU_KV_BYTES},
}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def on_device(request) -> dict:
    """The engine arguments for the device this case runs on (ENGINE_ARGS_ON)."""
    return ENGINE_ARGS_ON[request.param]
