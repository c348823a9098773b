"""Holds requests until their grammar is compiled, so no step ever waits for a compile.

A held request is in the engine (abort, pause and failure reach it) but not in the scheduler:
it takes no batch slot and no KV block. Each compile runs on a thread of its own; once one is
done, the request goes to the scheduler, or ends with finish_reason "error" and the message. A
compile not done within the timeout (`structured_outputs_config.compilation_timeout_s`) ends
its request, and one still waiting for a thread when its request is dropped never starts.

The backend's own build, once per process (reading the tokenizer's vocabulary: seconds, more
on a loaded machine), is no request's compile: a deadline never falls before the backend has
been ready for the whole timeout. (The first guidance request on a busy 2-core machine once
timed out on the build alone.)

A running compile cannot be stopped (the grammar engine's C++ runs to its end), so one that
outlives its request (aborted, or timed out) is abandoned: it runs on, its result unused, and no
longer counts against `max_compiles`, so it holds up no later request. Abandoned compiles still
take a thread and a core each, so at most ABANDONED_THREADS more compile threads live at once;
past that, compiles wait their turn, and their timeout, counted from arrival, still ends them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Callable

from treadle.request import Request
from treadle.structured_output.backend import GrammarBackend, GrammarError
from treadle.structured_output.compile_thread import compile_on_thread
from treadle.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiles running at once for held requests: as vLLM, half the CPUs, but two at least, so that
# one slow grammar does not hold up every other until it times out.
MAX_COMPILES = max(2, ((os.cpu_count() or 1) + 1) // 2)
# Abandoned compiles that may still run beside those.
ABANDONED_THREADS = 6


class GrammarGate:
    def __init__(self, get_backend: Callable[[], GrammarBackend], timeout_s: float,
                 max_compiles: int = MAX_COMPILES) -> None:
        self._get_backend = get_backend
        self._timeout_s = timeout_s
        self._max_compiles = max_compiles
        self._held: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        # The rest is shared with the compile threads and the deadline watch, under the lock.
        self._lock = threading.Lock()
        self._queue: deque[tuple[concurrent.futures.Future, StructuredOutputsParams, str]] = deque()
        self._counted: set[concurrent.futures.Future] = set()   # running, for a held request
        self._num_threads = 0
        self._deadlines: list[tuple[float, int, concurrent.futures.Future, str]] = []   # a heap
        self._order = itertools.count()   # breaks ties between equal deadlines
        self._deadline_changed = threading.Condition(self._lock)
        self._backend_ready_at: float | None = None   # when the backend was first at hand
        self._parked: list[tuple[int, concurrent.futures.Future, str]] = []   # past their
        # deadline while the backend was still being built: they get timeout_s from its end
        self._watch: threading.Thread | None = None
        self._closed = False
        # Called when a compile ends (any thread): the engine thread may be asleep.
        self.on_compiled: Callable[[], None] | None = None

    def hold(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._held[request.request_id] = (request, future)
        future.add_done_callback(self._notify)
        with self._lock:
            self._queue.append((future, params, request.request_id))
            self._start_queued()
            if self._timeout_s > 0:
                deadline = time.monotonic() + self._timeout_s
                heapq.heappush(self._deadlines, (deadline, next(self._order), future,
                                                 request.request_id))
                self._deadline_changed.notify()
                if self._watch is None:
                    self._watch = threading.Thread(target=self._watch_deadlines, daemon=True,
                                                   name="treadle-grammar-deadlines")
                    self._watch.start()

    def _notify(self, _: concurrent.futures.Future) -> None:
        if self.on_compiled is not None:
            self.on_compiled()

    def _start_queued(self) -> None:
        """Start waiting compiles while there is room (under the lock)."""
        while (self._queue and not self._closed and len(self._counted) < self._max_compiles
               and self._num_threads < self._max_compiles + ABANDONED_THREADS):
            future, params, request_id = self._queue.popleft()
            if future.done():   # cancelled (its request dropped) or timed out while waiting
                continue
            logger.debug("request %s: its grammar compiles", request_id)
            future.set_running_or_notify_cancel()
            self._counted.add(future)
            self._num_threads += 1
            compile_on_thread(self._backend, params, f"treadle-grammar-{request_id}",
                              functools.partial(self._compiled, future))

    def _backend(self) -> GrammarBackend:
        """The backend (on a compile thread); the first time, the deadlines parked while it
        was built start counting again, from now."""
        backend = self._get_backend()
        with self._lock:
            if self._backend_ready_at is None:
                self._backend_ready_at = now = time.monotonic()
                for order, future, request_id in self._parked:
                    heapq.heappush(self._deadlines,
                                   (now + self._timeout_s, order, future, request_id))
                self._parked.clear()
                self._deadline_changed.notify()
        return backend

    def _compiled(self, future: concurrent.futures.Future, compiled: object,
                  error: Exception | None) -> None:
        """A compile ended (on its thread): its request's future gets the result or the error,
        which take_compiled reports."""
        with self._lock:
            self._num_threads -= 1
            self._counted.discard(future)
            if not future.done():   # else abandoned: the result goes unused (yet is cached)
                if error is None:
                    future.set_result(compiled)
                else:
                    future.set_exception(error)
            self._start_queued()

    def _watch_deadlines(self) -> None:
        """Ends each compile that is not done by its deadline (one thread for all of them)."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    deadline, order, future, request_id = heapq.heappop(self._deadlines)
                    ready = self._backend_ready_at
                    if future.done():
                        continue
                    if ready is None:   # still building the backend: not the compile's time
                        self._parked.append((order, future, request_id))
                    elif ready + self._timeout_s > deadline:   # it arrived before the backend
                        heapq.heappush(self._deadlines,
                                       (ready + self._timeout_s, order, future, request_id))
                    else:
                        self._time_out(future, request_id)
                self._deadline_changed.wait(self._deadlines[0][0] - now if self._deadlines else None)

    def _time_out(self, future: concurrent.futures.Future, request_id: str) -> None:
        """End a compile, running or waiting, that passed its deadline (under the lock)."""
        running = future in self._counted
        self._counted.discard(future)
        future.set_exception(GrammarError(
            f"structured_outputs: the grammar was not compiled within {self._timeout_s:g} s of "
            f"the request's arrival (structured_outputs_config.compilation_timeout_s)"))
        if running:
            logger.warning("request %s: its grammar compile passed %g s; it runs on, unused",
                           request_id, self._timeout_s)
            self._start_queued()

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile ended, in arrival order: (ready, [(failed, message)])."""
        ready, failed = [], []
        for rid, (request, future) in list(self._held.items()):
            if not future.done():
                continue
            del self._held[rid]
            error = future.exception()
            if error is None:
                ready.append(request)
            else:
                logger.info("request %s: its grammar did not compile: %s", rid, error)
                failed.append((request, str(error)))
        return ready, failed

    def has_compiled(self) -> bool:
        return any(future.done() for _, future in self._held.values())

    def wait(self, timeout: float) -> None:
        """Wait until some held request's compile ends (or `timeout` seconds pass)."""
        concurrent.futures.wait([f for _, f in self._held.values()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def drop(self, request_ids: list[str]) -> list[str]:
        """Forget held requests (aborted or ended from outside); returns the ids it held. A
        compile still waiting for a thread is cancelled; a running one is abandoned."""
        dropped = [rid for rid in dict.fromkeys(request_ids) if rid in self._held]
        with self._lock:   # all of them before any waiting compile takes a freed place
            for rid in dropped:
                future = self._held.pop(rid)[1]
                if future in self._counted:
                    self._counted.discard(future)
                    logger.info("request %s: dropped while its grammar compiles; the compile "
                                "runs on, unused", rid)
                future.cancel()
            self._start_queued()
        return dropped

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def request_ids(self) -> list[str]:
        return list(self._held)

    def requests(self) -> list[Request]:
        return [request for request, _ in self._held.values()]

    def shutdown(self) -> None:
        """Start no more compiles (running ones run to their end)."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._deadline_changed.notify()
