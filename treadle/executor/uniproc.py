"""Executor with a single worker in this process (CPU, or one GPU)."""

from __future__ import annotations

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: TreadleConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.init_kv_cache(self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
