"""A worker owns one device: the model, its slice of the KV cache and the model runner."""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from treadle.config import TreadleConfig, kv_cache_sized_by_profile, num_blocks_from_budget
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.distributed.parallel_state import ParallelContext
from treadle.structured_output.params import StructuredOutputsParams
from treadle.worker.deferred_step import DeferredStep
from treadle.worker.memory_profile import (MiB, MemoryProfile, free_device_memory,
                                           measure_graph_capture, profile_memory)
from treadle.worker.model_runner import ModelRunner
from treadle.worker.weight_transfer import WeightReceiver

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: TreadleConfig, ctx: ParallelContext | None = None) -> None:
        self.config = config
        self.ctx = ctx or ParallelContext()
        # The device's free memory before this worker takes any: the KV cache is sized
        # against it (worker/memory_profile.py).
        self.free_at_start = (free_device_memory(torch.device(config.device))
                              if kv_cache_sized_by_profile(config) else None)
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, self.ctx)
        self.memory_profile: MemoryProfile | None = None   # where the KV cache was profiled
        self.graph_pool = 0   # what the CUDA graphs captured at start-up hold, so measured
        self.weight_receiver = WeightReceiver(config.weight_transfer, self.runner, self.ctx)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        profiled = None
        if self.free_at_start is not None:
            self.memory_profile = profile_memory(self.runner, self.free_at_start)
            profiled = self.memory_profile.kv_cache_bytes(self.config.cache.gpu_memory_utilization)
        return num_blocks_from_budget(self.config, self.runner.kv_block_bytes(), profiled)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)
        if self.memory_profile is None or not self.runner.serves_graphs:
            self.runner.capture_graphs()
            return
        # The KV cache was sized with the graphs' pool as the profile measured it: say what the
        # capture for good takes, so that a difference shows in the log.
        self.graph_pool = measure_graph_capture(self.runner)
        logger.info("CUDA graphs hold %.1f MiB (the profile counted %.1f MiB)",
                    self.graph_pool / MiB, self.memory_profile.graph_pool / MiB)

    def release_kv_cache(self) -> None:
        """At shutdown: the KV cache's memory goes back to the device."""
        self.runner.free_kv_cache()
        self.runner.on_device.release_cached_memory()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | DeferredStep:
        """The step's output, or the step deferred (worker/deferred_step.py: only where the
        in-process executor allowed it, which finishes it)."""
        return self.runner.execute_model(scheduler_output)

    def warm_grammar(self, params: StructuredOutputsParams) -> None:
        """A request with this grammar has arrived: where this rank samples, compile it now, off
        the step path (structured_output/compile_ahead.py). Never raises: nobody waits for it."""
        if self.runner.grammars is not None:
            self.runner.grammars.ahead.start(params)

    def pipeline_stats(self) -> dict[str, float]:
        """Sampled-token messages between pipeline stages so far, and the time spent waiting
        for other stages (all zero with one stage)."""
        link = self.runner.link
        return {"rank": self.ctx.rank,
                "sampled_sends": link.num_sampled_sends if link is not None else 0,
                "sampled_recvs": link.num_sampled_recvs if link is not None else 0,
                "recv_wait_s": link.recv_wait_s if link is not None else 0.0}

    # -- RL controls -----------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.runner.update_weights(named_tensors)

    def load_weights(self, path: str) -> int:
        return self.runner.load_weights(path)

    def check_weights(self, source: list[tuple[str, tuple[int, ...]]] | str) -> None:
        self.runner.check_weights(source)

    def torn_weights(self) -> bool:
        return self.runner.torn_weights

    # Weights from a trainer process: the engine drives these (engine/weight_transfer.py).
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.weight_receiver.init(init_info)

    def weight_transfer_joined(self) -> bool:
        return self.weight_receiver.joined()

    def start_weight_update(self) -> None:
        self.weight_receiver.start()

    def check_weight_update(self, update_info: dict[str, Any]) -> None:
        self.weight_receiver.check(update_info)

    def receive_weights(self, update_info: dict[str, Any]) -> int:
        return self.weight_receiver.receive(update_info)

    def check_staged_weights(self) -> None:
        self.weight_receiver.check_staged()

    def finish_weight_update(self) -> tuple[int, str | None]:
        return self.weight_receiver.finish()

    def abort_weight_update(self, close_group: bool) -> None:
        self.weight_receiver.abort(close_group)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.runner.wake_up(tags)
