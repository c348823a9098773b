"""Executor with a single worker in this process (CPU, or one GPU).

With async scheduling, steps run on one worker thread, in the order they were submitted, so the
engine can schedule the next step while this one computes (torch releases the GIL in its ops).
Every other call to the worker goes through the same thread, after the steps before it.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: TreadleConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.init_kv_cache(self.num_blocks)
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix="treadle-worker")
                        if config.scheduler.async_scheduling else None)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        if non_block and self._thread is not None:
            return self._thread.submit(self.worker.execute_model, scheduler_output)
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker (a Worker method name, or a callable taking the worker)."""
        fn = (getattr(self.worker, method) if isinstance(method, str)
              else functools.partial(method, self.worker))
        if self._thread is not None:
            return [self._thread.submit(fn, *args, **(kwargs or {})).result()]
        return [fn(*args, **(kwargs or {}))]

    def failure(self) -> str | None:
        """None: the worker lives in this process, and its failures are raised where they happen."""
        return None

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
