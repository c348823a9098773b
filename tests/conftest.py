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


# The slowest test files, slowest first (seconds in one process on 2 cores, Nov 30). `make test`
# hands whole files (--dist loadfile) to whichever of its two workers is free, in collection
# order: these start early and the short files fill in at the end, so that neither worker is
# left alone with a long file at the end while the other has nothing to do. Left to itself,
# xdist takes the files with the most tests first, and a long file of one test (such as the
# kernels' portability check) came last. The rest keep their alphabetical order.
SLOWEST_FILES = (
    "test_parallel.py",                   # 321
    "test_kv_parallel.py",                # 199
    "test_structured_outputs.py",         # not timed alone; its 3 slowest tests took 89 in CI
    "test_triton_attention.py",           # 106
    "test_kernel_portability.py",         # 99
    "test_ray_executor.py",               # 97
    "test_console.py",                    # 97
    "test_correctness.py",                # 87
    "test_quantization.py",               # 70
    "test_async_scheduling.py",           # 67
    "test_malloc.py",                     # 66
    "test_gguf_quantization.py",          # 62
    "test_grammar_after_reasoning.py",    # 61
    "test_grammar_stop_ids.py",           # 54
    "test_exactness.py",                  # 49
    "test_server.py",                     # 47
    "test_server_structured.py",          # 45
    "test_bad_words.py",                  # 43
    "test_rl_examples.py",                # 41
    "test_loader.py",                     # 41
    "test_gemma.py",                      # 41
    "test_llm_api.py",                    # 40
    "test_ruled_out.py",                  # 39
    "test_bench.py",                      # 39
    "test_rl_controls.py",                # 38
    "test_kv_interleavings.py",           # 36
    "test_chat_cli.py",                   # 35
    "test_request_fields.py",             # 33
    "test_kv_redis.py",                   # 33
    "test_cli.py",                        # 30
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # xdist: keep SLOWEST_FILES' order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's order kept
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
