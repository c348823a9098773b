"""Executors: how the engine drives its workers. `uni` runs one in this process; `mp` runs one
process per rank on this host. `ray` (across hosts) is the next one: it takes the same calls
(execute_model, collective_rpc, check_health, shutdown) and the same `num_blocks`."""

from __future__ import annotations

from treadle.config import TreadleConfig


def create_executor(config: TreadleConfig):
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from treadle.executor.mp import MultiprocExecutor
        return MultiprocExecutor(config)
    from treadle.executor.uniproc import UniProcExecutor
    return UniProcExecutor(config)
