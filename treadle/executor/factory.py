"""Builds the executor a config names."""

from __future__ import annotations

from treadle.config import TreadleConfig
from treadle.executor.base import Executor
from treadle.executor.registry import EXECUTORS
from treadle.registry import lookup


def create_executor(config: TreadleConfig) -> Executor:
    """The executor `config.parallel.distributed_executor_backend` names, with its workers
    started; a ValueError listing the backends if it names none."""
    backend = config.parallel.distributed_executor_backend
    return lookup(EXECUTORS, backend, "distributed_executor_backend")(config)
