"""The executor contract (executor/base.py), pinned on both real executors with a tiny model:
`uni` (in this process, with and without its worker thread) and `mp` (two worker processes,
one per pipeline stage, so that the ranks differ in the KV blocks they can hold)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import pytest

from treadle import EngineArgs
from treadle.core.scheduler_output import CachedRequestData, SchedulerOutput
from treadle.executor.factory import create_executor
from treadle.executor.base import SHUT_DOWN, Executor, WorkerFailedError
from treadle.structured_output.params import StructuredOutputsParams

BACKENDS = {
    "uni": {},
    "uni-async": {"async_scheduling": True},
    "mp": {"pipeline_parallel_size": 2},
}


def start(path: str, backend: str) -> Executor:
    # A byte budget, not a block count: the stages hold 2 and 1 of the 3 layers, so each
    # rank could hold a different number of blocks. A step budget of max_model_len, not the
    # default 2,048: no step runs here, and a last stage warms its head's GEMM (the tied
    # embedding's copy, 49,152 rows) up to the budget at start-up.
    config = EngineArgs(path, block_size=16, kv_cache_memory_bytes=1 << 20, max_model_len=256,
                        max_num_batched_tokens=256, **BACKENDS[backend]).create_config()
    return create_executor(config)


def rank_of(worker) -> int:
    return worker.ctx.rank


def blocks_allocated(worker) -> int:
    return worker.runner.kv_caches[0].shape[1]


def refuse(worker, why: str) -> None:
    raise ValueError(why)


def empty_step() -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0)


# One executor per backend goes through the whole life: a worker group costs seconds to start.
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_contract_while_alive_and_after_shutdown(tiny_checkpoints, backend):
    executor = start(tiny_checkpoints["llama"], backend)
    ranks = list(range(executor.world_size))
    try:
        assert executor.failure() is None
        # Every worker holds the least block count of any rank.
        counts = executor.collective_rpc("determine_num_blocks")
        assert executor.num_blocks == min(counts)
        assert executor.collective_rpc(blocks_allocated) == [executor.num_blocks] * len(ranks)
        if len(ranks) > 1:
            assert len(set(counts)) > 1, "the stages should differ, or min() is not exercised"
        assert executor.collective_rpc(rank_of) == ranks

        # A caller's error keeps its type, and the workers stay fine.
        with pytest.raises(ValueError, match="no such weights"):
            executor.collective_rpc(refuse, ("no such weights",))
        assert executor.failure() is None
        assert executor.collective_rpc(rank_of) == ranks
    finally:
        executor.shutdown()
    executor.shutdown()   # idempotent

    if backend == "mp":   # a healthy group is asked to exit, not killed
        assert [proc.exitcode for proc in executor.procs] == [0] * len(ranks)
    assert executor.failure() == SHUT_DOWN
    for call in (lambda: executor.collective_rpc(rank_of),
                 lambda: executor.execute_model(empty_step()),
                 lambda: executor.execute_model(empty_step(), non_block=True)):
        with pytest.raises(WorkerFailedError, match=SHUT_DOWN):
            call()
    executor.warm_grammar(StructuredOutputsParams(regex="a+"))   # a hint: never raises


def test_a_dead_worker_ends_the_group_with_the_first_reason(tiny_checkpoints):
    executor = start(tiny_checkpoints["llama"], "mp")
    try:
        os.kill(executor.procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while executor.failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reason = "worker rank 1 died (exit code -9)"
        assert executor.failure() == reason
        for _ in range(2):   # the call that finds the death, and every later one
            with pytest.raises(WorkerFailedError, match=re.escape(reason)):
                executor.collective_rpc(rank_of)
        assert executor.procs[0].exitcode == -signal.SIGKILL, "the other rank is killed at once"
    finally:
        executor.shutdown()
    assert executor.failure() == reason   # shutdown does not hide why the group ended
    with pytest.raises(WorkerFailedError, match=re.escape(reason)):
        executor.execute_model(empty_step())


def test_an_unknown_backend_names_the_choices(tiny_checkpoints):
    config = EngineArgs(tiny_checkpoints["llama"]).create_config()
    config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, distributed_executor_backend="threads"))
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray, "
                                         "uni; got 'threads'"):
        create_executor(config)
