"""Executor with a single worker in this process (CPU, or one GPU).

On the CPU with async scheduling, steps run on one worker thread, in the order they were
submitted, so the engine can schedule the next step while this one computes (torch releases the
GIL in its ops). Every other call to the worker goes through the same thread, after the steps
before it, and the worker is built there too: each thread that runs torch's parallel CPU ops gets
an OpenMP team of its own, and a second, idle team (the loader's) makes libgomp stop spinning at
barriers (engine/core_thread.py has the measurement).

On a GPU with async scheduling, a step's sampled tokens stay on the device until the next step
is queued behind it (worker/deferred_step.py): the worker returns the step deferred, having
waited for nothing, and its StepFuture finishes it when the engine asks for its output, unless
the next step already has. Deferred steps run on the engine's own thread: the device computes
beside the engine already, and a worker thread would only hand each step over and back and
share the GIL with it (on the H200, async scheduling with the steps on a thread made a step at
256 requests 19% longer than none). Where the runner cannot defer (n-gram drafts, a KV
connector), a step waits for its tokens, so it runs on a worker thread, and the engine
schedules the next one meanwhile.

The worker shares this process, so its failures are raised where they happen, as their own
type, and leave no failure state here: a failed step ends the engine (EngineCore turns any
step's error into EngineDeadError), and there is no group to replace (config.py refuses
`max_worker_restarts` with this executor). Only shutdown ends it.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.executor.base import Executor
from treadle.structured_output.params import StructuredOutputsParams
from treadle.worker.deferred_step import DeferredStep
from treadle.worker.malloc import keep_freed_memory
from treadle.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: TreadleConfig) -> None:
        cpu = config.device.startswith("cpu")
        if cpu:
            keep_freed_memory()   # before the worker thread's first allocation picks its arena
        self._thread = _worker_thread() if config.scheduler.async_scheduling and cpu else None
        super().__init__(config)

    def _start_workers(self, config: TreadleConfig) -> list[int]:
        self.worker = self._on_worker_thread(_build_worker, config)
        if (config.scheduler.async_scheduling and config.device.startswith("cuda")
                and not self.worker.runner.allow_deferred_steps()):
            self._thread = _worker_thread()   # its steps wait for their tokens: see the module
        return [self._on_worker_thread(self.worker.determine_num_blocks)]

    def _on_worker_thread(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if self._thread is None:
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def _execute_model(self, scheduler_output: SchedulerOutput,
                       non_block: bool) -> ModelRunnerOutput | StepFuture:
        if self._thread is None or self.worker.runner.defer_steps:
            # On this thread (deferred steps wait for nothing: see the module).
            if not non_block:
                out = self.worker.execute_model(scheduler_output)
                return self._finish_deferred(out) if isinstance(out, DeferredStep) else out
            returned: Future = Future()
            try:
                returned.set_result(self.worker.execute_model(scheduler_output))
            except Exception as e:   # raised as its output is asked for, as from the thread
                returned.set_exception(e)
            return StepFuture(returned, self._finish_deferred)
        future = StepFuture(self._thread.submit(self.worker.execute_model, scheduler_output),
                            self._finish_deferred)
        return future if non_block else future.result()

    def _finish_deferred(self, step: DeferredStep) -> ModelRunnerOutput:
        return self.worker.runner.finish_deferred(step)   # where deferred steps run: this thread

    def _warm_grammar(self, params: StructuredOutputsParams) -> None:
        """Nothing to do: the worker shares this process's grammar backend, whose cache the
        engine core's own compile fills."""

    def _collective_rpc(self, method: str | Callable, args: tuple,
                        kwargs: dict[str, Any]) -> list[Any]:
        fn = (getattr(self.worker, method) if isinstance(method, str)
              else functools.partial(method, self.worker))
        return [self._on_worker_thread(fn, *args, **kwargs)]

    def _close(self, graceful: bool) -> None:
        """Steps already submitted finish first: the worker cannot be killed, only left. Its KV
        cache goes at once, even while the LLM object lives on (`with LLM(...) as llm` keeps
        it): on a GPU, the next engine in this process sizes its own against free memory."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if hasattr(self, "worker"):   # absent when building it failed
            self.worker.release_kv_cache()


class StepFuture:
    """A step's output to come: the worker's, or, where the worker deferred the step, its
    finished output (finished on the first ask, unless the next step did)."""

    def __init__(self, submitted: Future, finish: Callable[[DeferredStep], ModelRunnerOutput]) -> None:
        self._submitted, self._finish = submitted, finish

    def result(self) -> ModelRunnerOutput:
        out = self._submitted.result()
        if isinstance(out, DeferredStep):
            return out.output if out.output is not None else self._finish(out)
        return out


def _worker_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="treadle-worker")


def _build_worker(config: TreadleConfig) -> Worker:
    worker = Worker(config)
    worker.load_model()
    return worker
