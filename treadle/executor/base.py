"""The executor contract, written once: how the engine drives its group of workers, whatever
carries the calls (a thread here, processes over ZeroMQ, Ray actors across hosts).

A subclass supplies the transport only: `_start_workers`, `_execute_model`, `_collective_rpc`,
`_warm_grammar` and `_close`, and `_find_failure` where workers can die on their own. The start-up
sequence, the dead-check and idempotent shutdown live here.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, NoReturn, Protocol

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.engine.errors import EngineDeadError
from treadle.kv_transfer.aggregate import KVOutputAggregator
from treadle.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

SHUT_DOWN = "the executor was shut down"


class WorkerFailedError(EngineDeadError):
    """The worker group is gone (a worker died or failed a step, or the executor was shut
    down): this call and every later one fail with the same reason."""


class PendingOutput(Protocol):
    """A step sent with `non_block=True`; result() waits for its output (or raises its failure)."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    """Drives `world_size` workers (treadle.worker.Worker), one per rank.

    Contract, the same for every backend:
      - `num_blocks`: the KV blocks every worker allocated, the least any rank could hold, so
        that all ranks hold the same count. Fixed at start-up.
      - `execute_model(scheduler_output, non_block)`: one step on every rank; its output (one
        rank's, the last pipeline stage's, with every rank's KV connector report united into
        it by `kv_outputs`) or, with non_block, a PendingOutput. Steps run in the order sent.
      - `collective_rpc(method, args, kwargs)`: run a Worker method (by name) or a callable
        taking the worker (module-level, where the worker is in another process) on every
        rank; the results in rank order. An error raised by the call is the caller's (bad
        weights, a path that is not there): it is raised here as its own type (ValueError, …)
        and the workers stay fine.
      - `warm_grammar(params)`: a hint, sent as a request arrives; nobody waits for it and it
        never raises, even once the group is gone.
      - `failure()`: None while the group is alive, else why it is not. Changes nothing, so
        any thread may ask.
      - `shutdown()`: stops the workers and frees the transport. Idempotent.
    Once the group is gone (a failure the transport detects, or shutdown) every call raises
    WorkerFailedError with that reason, at once, and the first reason is kept.
    """

    def __init__(self, config: TreadleConfig) -> None:
        """Start the workers, ask each for its KV block count, and give every one the least."""
        self.world_size = config.parallel.world_size
        # With a KV connector on several ranks, every rank's step output is read: each reports
        # the loads of its own part of the blocks (kv_transfer/aggregate.py).
        self.kv_outputs = (KVOutputAggregator(self.world_size)
                           if config.kv_transfer is not None and self.world_size > 1 else None)
        self._dead: str | None = None
        self._closed = False
        try:
            self.num_blocks: int = min(self._start_workers(config))
            self.collective_rpc("init_kv_cache", (self.num_blocks,))
        except BaseException:
            self.shutdown()
            raise

    # -- the calls ---------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | PendingOutput:
        self._check_alive()
        return self._execute_model(scheduler_output, non_block)

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        self._check_alive()
        return self._collective_rpc(method, args, kwargs or {})

    def warm_grammar(self, params: StructuredOutputsParams) -> None:
        if self._dead is None:
            self._warm_grammar(params)

    def failure(self) -> str | None:
        return self._dead if self._dead is not None else self._find_failure()

    def fail(self, reason: str) -> NoReturn:
        """Give the group up as if it had died, with `reason` (its weights torn by a change
        that failed part way): it is stopped, and raises WorkerFailedError, as every later
        call does."""
        self._fail(reason)

    def shutdown(self) -> None:
        """Stop the workers (asking them to exit while the group is healthy, else at once)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close(graceful=self.failure() is None)
        finally:
            self._dead = self._dead or SHUT_DOWN

    # -- for subclasses ------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerFailedError(self._dead)

    def _fail(self, reason: str, detail: str = "") -> NoReturn:
        """The group is gone: keep the reason for every later call, stop what is left of it,
        and raise. `detail` (a worker's traceback) goes to the log only."""
        logger.error("%s%s", reason, f"\n{detail}" if detail else "")
        self._dead = reason
        self.shutdown()
        raise WorkerFailedError(reason)

    @abstractmethod
    def _start_workers(self, config: TreadleConfig) -> list[int]:
        """Build and start every worker, loading the model; returns each rank's KV block
        count (Worker.determine_num_blocks), in rank order. Any failure here is fatal."""

    @abstractmethod
    def _execute_model(self, scheduler_output: SchedulerOutput,
                       non_block: bool) -> ModelRunnerOutput | PendingOutput: ...

    @abstractmethod
    def _collective_rpc(self, method: str | Callable, args: tuple,
                        kwargs: dict[str, Any]) -> list[Any]: ...

    @abstractmethod
    def _warm_grammar(self, params: StructuredOutputsParams) -> None:
        """Must not raise."""

    @abstractmethod
    def _close(self, graceful: bool) -> None:
        """Stop every worker and free the transport; called once, also after a failed start
        (with whatever was built). Not graceful: kill, do not wait."""

    def _find_failure(self) -> str | None:
        """A failure the transport sees before any call does (a worker that exited), or None.
        Must change nothing: failure() may ask from any thread."""
        return None
