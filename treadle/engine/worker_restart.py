"""Replacing a worker group that failed, with no request lost (`max_worker_restarts`).

The steps in flight are lost with the workers, and so is every block of KV they held. So every
running request is preempted: its output so far is kept, and it resumes by recompute, as after
any preemption. The lost steps are then accounted for as if they had come back: everything
they carried was made stale by the preemption, so the token ledger drops it, and their
counters settle exactly as for steps that returned. Then the prefix cache is emptied, since
the new workers' KV cache holds nothing, and a new group starts with the same configuration.

Only where a restart can restore everything: the weights served (the checkpoint, or the files
of the last `load_weights`, which the new workers load again; never after weights were changed
in place, which no file holds: `ServedWeights.restart_refusal`), and not with a KV connector
(whose transfers in flight cannot be replayed).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.executor.factory import create_executor

if TYPE_CHECKING:
    from treadle.config import TreadleConfig
    from treadle.core.scheduler import Scheduler
    from treadle.engine.weights import ServedWeights
    from treadle.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)


class RestartingCore(Protocol):
    """What a restart reads and changes of the engine core."""

    config: TreadleConfig
    scheduler: Scheduler
    executor: Any
    connector: KVConnectorBase | None
    batch_queue: deque[tuple[Any, SchedulerOutput]]
    asleep: set[str]
    weights: ServedWeights
    num_worker_restarts: int


def restart_refusal(core: RestartingCore) -> str | None:
    """None if the worker group may be replaced now; else what to add to the failure's message
    (nothing when restarts are off)."""
    allowed = core.config.parallel.max_worker_restarts
    if allowed == 0:
        return ""
    if core.num_worker_restarts >= allowed:
        why = f"all {allowed} restarts allowed (max_worker_restarts) were used"
    elif core.connector is not None:
        why = "a KV connector's transfers in flight cannot be replayed"
    elif core.asleep:
        why = "the engine is asleep"
    else:
        why = core.weights.restart_refusal()
        if why is None:
            return None
    return f"; the workers were not restarted: {why}"


def restart_workers(core: RestartingCore, reason: str) -> None:
    # Counted once the new group is up: until then restart_refusal (which failure() reads,
    # for /health, from another thread) must not count this restart's slot as used.
    number = core.num_worker_restarts + 1
    scheduler = core.scheduler
    lost = [sched_out for _, sched_out in core.batch_queue]
    core.batch_queue.clear()
    num_resumed = len(scheduler.running)
    scheduler.reset_prefix_cache(reset_running_requests=True)
    for sched_out in lost:
        outputs = scheduler.update_from_output(sched_out, _stale_output(sched_out))
        assert not outputs, "a lost step produced output after its requests were preempted"
    if not scheduler.kv_cache.reset_prefix_cache():
        raise RuntimeError("KV blocks are still held after every request was preempted")
    logger.warning("%s: restarting the workers (%d of %d); %d requests resume by recompute",
                   reason, number, core.config.parallel.max_worker_restarts,
                   num_resumed)
    core.executor.shutdown()   # first: its store's port and its memory go back
    # Exactly the scheduler's blocks, not a budget measured again, which could differ.
    num_blocks = scheduler.kv_cache.pool.num_blocks
    config = dataclasses.replace(
        core.config, cache=dataclasses.replace(core.config.cache, num_kv_blocks=num_blocks))
    executor = create_executor(config)
    if core.weights.source is not None:   # the weights served came from these files
        try:
            executor.collective_rpc("load_weights", (core.weights.source,))
        except BaseException:
            executor.shutdown()
            raise
    core.executor, core.num_worker_restarts = executor, number


def _stale_output(sched_out: SchedulerOutput) -> ModelRunnerOutput:
    """What a lost step would have returned, as far as the ledger can tell: a token for every
    request that sampled (all of them stale now), nothing for the others."""
    req_ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[[0] if sched_out.num_in_flight_tokens.get(r) else [] for r in req_ids])
