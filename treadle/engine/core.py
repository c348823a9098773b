"""EngineCore: the step loop joining the scheduler and the executor."""

from __future__ import annotations

import logging

from treadle.config import TreadleConfig
from treadle.core.scheduler import EngineCoreOutput, Scheduler
from treadle.executor.uniproc import UniProcExecutor
from treadle.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: TreadleConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        num_blocks = self.executor.num_blocks
        cache, model = config.cache, config.model
        capacity = (num_blocks - 1) * cache.block_size
        if model.max_model_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it",
                           model.max_model_len, capacity)
            model.max_model_len = capacity
        self.scheduler = Scheduler(config.scheduler, cache, num_blocks, model.max_model_len,
                                   seed=model.seed)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); max concurrency %.1fx at %d tokens",
                    num_blocks, cache.block_size,
                    num_blocks * cache.bytes_per_block(model) / 2**20,
                    capacity / model.max_model_len, model.max_model_len)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and account for one step; returns what each request produced."""
        if not self.scheduler.has_unfinished_requests():
            return []
        sched_out = self.scheduler.schedule()
        runner_out = self.executor.execute_model(sched_out)
        if sched_out.is_empty:
            # Every known request fits on its own, so an idle step with work waiting is a bug.
            raise RuntimeError("scheduler made no progress with requests waiting")
        return self.scheduler.update_from_output(sched_out, runner_out)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
