"""Grammars compiled ahead of the step in a worker process (the mp executor's ranks that sample).

The engine core tells the workers a constrained request's grammar when the request arrives
(`Worker.warm_grammar`), while its own gate compiles the same grammar; the request is scheduled
only once that compile is done, so by its first step the worker's is done too, or nearly, and
the step waits only for what is left of it instead of compiling from the start. In the engine
core's process (the uni executor) its compile already fills the backend's cache, which the
runner shares, so nothing is sent.

A compile started ahead runs to its end even if its request is aborted or times out in the gate
(a C++ compile cannot be stopped); at most MAX_AHEAD run at once, and a grammar past that is
compiled on the step, as it was before.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any, Callable

from treadle.structured_output.backend import GrammarBackend
from treadle.structured_output.compile_thread import compile_on_thread
from treadle.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_AHEAD = 4


class CompileAhead:
    def __init__(self, get_backend: Callable[[], GrammarBackend]) -> None:
        self._get_backend = get_backend
        self._lock = threading.Lock()
        # Compiles running, by constraint; a finished one leaves, its result in the backend's cache.
        self._running: dict[tuple, concurrent.futures.Future] = {}

    def start(self, params: StructuredOutputsParams) -> None:
        """Start compiling `params` on a thread of its own, unless it already compiles."""
        with self._lock:
            if params.key in self._running or len(self._running) >= MAX_AHEAD:
                return
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._running[params.key] = future
        compile_on_thread(self._get_backend, params, "treadle-grammar-ahead",
                          functools.partial(self._compiled, params, future))

    def _compiled(self, params: StructuredOutputsParams, future: concurrent.futures.Future,
                  compiled: Any, error: Exception | None) -> None:
        if error is None:
            future.set_result(compiled)
        else:   # raised again by compiled(), on the step that needs it
            future.set_exception(error)
        with self._lock:
            del self._running[params.key]

    def compiled(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar: what is left of a compile started ahead, or a compile now (a
        cache hit when one ended before)."""
        with self._lock:
            future = self._running.get(params.key)
        start = time.perf_counter()
        compiled = future.result() if future is not None else self._get_backend().compile(params)
        logger.debug("a %s grammar was ready for its step in %.3f s%s", params.kind,
                     time.perf_counter() - start, " (compiled ahead)" if future is not None else "")
        return compiled
