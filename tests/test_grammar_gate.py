"""The grammar gate's compile threads, with the real xgrammar backend and a grammar that really
compiles for seconds: a compile past its timeout ends its request, the compile of a request
dropped before its turn never starts, and a compile that outlives its request (aborted, timed
out) holds up no later one."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid

import pytest

from treadle import SamplingParams
from treadle.models.loader import load_hf_config, prepare_model
from treadle.request import Request
from treadle.structured_output.backend import GrammarBackend
from treadle.structured_output.compile_thread import COMPILE_NICENESS, compile_on_thread
from treadle.structured_output.gate import GrammarGate
from treadle.structured_output.registry import get_backend

GATE_LOG = "treadle.structured_output.gate"


def slow_schema() -> dict:
    """A JSON schema xgrammar takes seconds to compile (1500 properties with a pattern each:
    about 3 s on one shared Xeon core), under new names each time so that no cache has it."""
    salt = uuid.uuid4().hex[:8]
    names = [f"{salt}_{i}" for i in range(1500)]
    return {"type": "object", "required": names, "properties": {
        n: {"type": "string", "pattern": "^[a-z]{3,9}-[0-9]{2,5}$"} for n in names}}


def quick_regex() -> dict:
    return {"regex": f"[0-9]{{3}}-{uuid.uuid4().hex[:8]}"}


@pytest.fixture(scope="module")
def backend(smollm2_path) -> GrammarBackend:
    path = prepare_model(smollm2_path)
    return get_backend("xgrammar", path, load_hf_config(path).vocab_size)


def _request(request_id: str, constraint: dict) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(structured_outputs=constraint), 2)


def _compiling(request_id: str) -> bool:
    """Whether the compile of `request_id` runs now (on its own thread, named after it)."""
    return any(t.name == f"treadle-grammar-{request_id}" for t in threading.enumerate())


def _take(gate: GrammarGate, num: int, timeout: float = 60.0
          ) -> tuple[list[Request], list[tuple[Request, str]]]:
    """Wait for `num` compiles to end: (ready, [(failed, message)])."""
    ready, failed = [], []
    deadline = time.monotonic() + timeout
    while len(ready) + len(failed) < num:
        assert time.monotonic() < deadline, "compiles did not end"
        gate.wait(0.05)
        more_ready, more_failed = gate.take_compiled()
        ready, failed = ready + more_ready, failed + more_failed
    return ready, failed


def test_a_compile_past_its_timeout_ends_its_request_and_holds_up_no_other(backend, caplog):
    gate = GrammarGate(lambda: backend, timeout_s=0.3, max_compiles=1)
    with caplog.at_level(logging.INFO, logger=GATE_LOG):
        gate.hold(_request("slow", {"json": slow_schema()}))
        _, failed = _take(gate, 1)
    assert [(r.request_id, "not compiled within 0.3 s" in m) for r, m in failed] == [("slow", True)]
    # It was compiling when its time ran out, and runs on, yet the next compile starts at once.
    assert "request slow: its grammar compile passed 0.3 s" in caplog.text
    assert _compiling("slow")
    gate.hold(_request("quick", quick_regex()))
    ready, _ = _take(gate, 1)
    assert [r.request_id for r in ready] == ["quick"] and _compiling("slow")
    assert len(gate) == 0
    gate.shutdown()


def test_the_backends_build_counts_against_no_requests_timeout(backend):
    """Building the backend (the tokenizer's vocabulary read, once per process) took llguidance
    more than the 10 s default on a loaded 2-core machine, and the first requests ended with an
    error: a deadline now starts no earlier than the backend is ready."""
    def build_slowly() -> GrammarBackend:
        time.sleep(1.0)
        return backend

    gate = GrammarGate(build_slowly, timeout_s=0.5, max_compiles=2)
    gate.hold(_request("first", quick_regex()))
    gate.hold(_request("second", quick_regex()))
    ready, failed = _take(gate, 2)
    assert sorted(r.request_id for r in ready) == ["first", "second"] and not failed
    gate.hold(_request("slow", {"json": slow_schema()}))   # the backend at hand: timed as ever
    _, failed = _take(gate, 1)
    assert [(r.request_id, "not compiled within 0.5 s" in m) for r, m in failed] == [("slow", True)]
    gate.shutdown()


def test_dropped_requests_compiles_hold_up_no_later_one(backend, caplog):
    """One compile at a time: `a` runs, `q` waits its turn, then both are dropped. `q` never
    starts, and `r` compiles while `a` still runs."""
    gate = GrammarGate(lambda: backend, timeout_s=0, max_compiles=1)
    with caplog.at_level(logging.DEBUG, logger=GATE_LOG):
        gate.hold(_request("a", {"json": slow_schema()}))
        gate.hold(_request("q", {"json": slow_schema()}))
        gate.hold(_request("r", quick_regex()))
        assert gate.drop(["a", "q", "unknown"]) == ["a", "q"]
        ready, failed = _take(gate, 1)
        assert [r.request_id for r in ready] == ["r"] and not failed
        assert _compiling("a")
    assert "request a: dropped while its grammar compiles" in caplog.text
    assert "request q: its grammar compiles" not in caplog.text
    assert "request r: its grammar compiles" in caplog.text
    gate.shutdown()


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_a_compile_runs_nicer_than_the_engine_and_so_do_the_threads_it_starts(backend):
    """On a machine of few cores a slow compile (or an abandoned one, running on) must not
    slow the steps of every running request: its thread, and the grammar engine's threads it
    starts, run COMPILE_NICENESS nicer than the engine's."""
    seen: dict[str, int] = {}

    class Watched:
        def compile(self, params):
            seen["compile"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            child = threading.Thread(target=lambda: seen.__setitem__(
                "child", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            child.start()
            child.join()
            return backend.compile(params)

    done = threading.Event()
    results: list = []
    params = SamplingParams(structured_outputs=quick_regex()).structured_outputs
    compile_on_thread(Watched, params, "treadle-grammar-nice",
                      lambda compiled, error: (results.append((compiled, error)), done.set()))
    assert done.wait(60)
    assert results[0][0] is not None and results[0][1] is None
    engine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == {"compile": min(engine + COMPILE_NICENESS, 19),
                    "child": min(engine + COMPILE_NICENESS, 19)}
