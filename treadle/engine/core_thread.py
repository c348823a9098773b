"""Runs an EngineCore's step loop on a background thread.

Only this thread touches the core, and it builds the core too. Other threads submit calls,
which run between steps in the order they were submitted, and get a concurrent.futures.Future
back. Outputs are handed to a callback after every step; the thread sleeps while the core has
nothing to do.

Why the core is built here: each thread that runs torch's parallel CPU ops gets an OpenMP team
of its own. Loading the model on the caller's thread left that thread a second, idle team, and
libgomp, seeing more threads than cores, then spins only briefly at each barrier before it
sleeps. The forward pass ran about 25% slower (batch-1 TPOT 30 against 24 ms, fp32, 2 cores;
docs/performance-log.md). With one thread doing all the torch work there is one team.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from treadle.core.scheduler_output import EngineCoreOutput
from treadle.engine.core import EngineCore
from treadle.engine.errors import EngineDeadError
from treadle.engine.weights import ServedWeights

logger = logging.getLogger(__name__)

# (outputs, the served weights that made them)
OutputCallback = Callable[[list[EngineCoreOutput], ServedWeights], None]
ErrorCallback = Callable[[BaseException], None]


class EngineCoreThread:
    def __init__(self, make_core: Callable[[], EngineCore], on_outputs: OutputCallback,
                 on_error: ErrorCallback) -> None:
        """Builds the core with `make_core()` on the new thread; raises what that raised."""
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._calls: queue.SimpleQueue[tuple[Callable, tuple, dict, Future] | None] = queue.SimpleQueue()
        self._idle_waiters: list[Future] = []
        self._stopping = False
        self._failure: BaseException | None = None   # what killed the core, if anything did
        self._lock = threading.Lock()
        built: Future = Future()
        self._thread = threading.Thread(target=self._build_and_run, args=(make_core, built),
                                        name="treadle-engine-core", daemon=True)
        self._thread.start()
        built.result()   # waits for the core; raises what building it raised

    def _build_and_run(self, make_core: Callable[[], EngineCore], built: Future) -> None:
        try:
            core = make_core()
        except BaseException as exc:
            built.set_exception(exc)
            return
        self.core: EngineCore = core
        # A finished compile is work for a thread that may be asleep on its call queue.
        core.grammars.on_compiled = lambda: self.submit(lambda: None)
        built.set_result(core)
        self._run()

    def failure(self) -> BaseException | None:
        """What killed the core, or None. Set before the dead requests' error outputs go out,
        so whoever reads one of those sees the engine dead here."""
        with self._lock:
            return self._failure

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> Future:
        """Run fn(*args, **kwargs) on the engine thread, between two steps."""
        return self._enqueue(Future(), fn, args, kwargs)

    def _enqueue(self, future: Future, fn: Callable, args: tuple, kwargs: dict) -> Future:
        with self._lock:   # not between the thread's last drain of the queue and its exit
            if self._failure is not None:
                future.set_exception(EngineDeadError(f"the engine core failed: {self._failure}"))
            elif self._stopping:
                future.set_exception(RuntimeError("the engine core has stopped"))
            else:
                self._calls.put((fn, args, kwargs, future))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run fn(core, *args, **kwargs) on the engine thread, between two steps. fn is an
        EngineCore method or a module-level function (engine/core_calls.py), as an engine core
        in a process of its own (engine/core_client.py) takes the same calls by name."""
        return self.submit(lambda: fn(self.core, *args, **kwargs))

    def call_into(self, future: Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """call(fn, *args, **kwargs), completing `future`: callbacks attached to it beforehand
        run on the engine thread, after the outputs the call produced (core_proc.py's replies)."""
        self._enqueue(future, lambda: fn(self.core, *args, **kwargs), (), {})

    def worker_failure(self) -> str | None:
        """EngineCore.failure(): a worker group that died and will not be replaced."""
        return self.core.failure()

    def when_idle(self) -> Future:
        """A future that completes once the core has no request and no step in flight."""
        future: Future = Future()

        def refused(registration: Future) -> None:   # the thread had stopped: never idle
            if registration.exception() is not None and not future.done():
                future.set_exception(registration.exception())

        self.submit(self._idle_waiters.append, future).add_done_callback(refused)
        return future

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                if self._idle_waiters and self.core.is_idle():
                    for future in self._idle_waiters:
                        if not future.done():   # a caller may have given up waiting
                            future.set_result(None)
                    self._idle_waiters.clear()
                if not self._run_calls(block=not self.core.has_work()):
                    break
                outputs = self.core.step() if self.core.has_work() else []
                if outputs:
                    self._on_outputs(outputs, self.core.weights)
        except BaseException as exc:  # the engine is dead: tell every waiter why
            logger.exception("engine core failed")
            with self._lock:
                self._stopping = True
                self._failure = exc
            # Outputs already produced go out; every request still in the engine ends with an
            # error that says why.
            for weights, held in self.core.take_held_outputs():
                self._on_outputs(held, weights)
            self._on_outputs(self.core.error_outputs(str(exc)), self.core.weights)
            self._on_error(exc)
            self._fail_waiting_calls(f"the engine core failed: {exc}")
        finally:
            with self._lock:
                self._stopping = True
            self._fail_waiting_calls("the engine core has stopped")
            self.core.shutdown()

    def _run_calls(self, block: bool) -> bool:
        """Run every queued call, first waiting for one if `block`; False once asked to stop."""
        while True:
            try:
                item = self._calls.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                return False
            block = False
            fn, args, kwargs, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except EngineDeadError as exc:   # a step failed inside the call: the engine is gone
                future.set_exception(exc)
                raise
            except Exception as exc:  # the caller's error, not the engine's
                future.set_exception(exc)
                continue
            # Outputs the call produced (a drain, an abort) go out before its result, and so
            # before any later call (a weight update) can run.
            for weights, held in self.core.take_held_outputs():
                self._on_outputs(held, weights)
            future.set_result(result)

    def _stopped_error(self, reason: str) -> Exception:
        return EngineDeadError(reason) if self._failure is not None else RuntimeError(reason)

    def _fail_waiting_calls(self, reason: str) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None and not item[3].done():
                item[3].set_exception(self._stopped_error(reason))
        for future in self._idle_waiters:
            if not future.done():
                future.set_exception(self._stopped_error(reason))
        self._idle_waiters.clear()
