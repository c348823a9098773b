"""Uniting the KV connector reports of a step's worker ranks (pipeline or tensor parallelism).

Each rank moves its own part of every block, so a block is loaded only when every rank loaded
its part: the step's load errors are those of any rank. A request's asynchronous load (or
send) is done once every rank has reported it done, which ranks may do in different steps; a
rank's load errors for it arrive with its report, so they are kept for the request until the
last rank's report and then handed on with it. Dropped saves add up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.kv_transfer.base import KVConnectorOutput

if TYPE_CHECKING:
    from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recving: dict[str, int] = {}   # request -> ranks that reported its load done
        self._sending: dict[str, int] = {}
        self._load_errors: dict[str, set[int]] = {}   # of asynchronous loads not yet done

    def aggregate(self, scheduler_output: SchedulerOutput, outputs: list[ModelRunnerOutput],
                  output_rank: int) -> ModelRunnerOutput:
        """The output rank's output, with every rank's KV connector report united into it.
        Called once per step, in the order the steps were sent."""
        # Blocks loaded synchronously this step: their errors are this step's alone.
        sync_blocks = {b for _, blocks, _ in scheduler_output.kv_loads.values() for b in blocks}
        united = KVConnectorOutput()
        for out in outputs:
            kv = out.kv_connector_output
            if kv is None:
                continue
            united.invalid_block_ids |= kv.invalid_block_ids
            async_errors = kv.invalid_block_ids - sync_blocks
            for rid in kv.finished_recving:
                self._load_errors.setdefault(rid, set()).update(async_errors)
                if self._count(self._recving, rid):
                    united.finished_recving.add(rid)
                    united.invalid_block_ids |= self._load_errors.pop(rid)
            for rid in kv.finished_sending:
                if self._count(self._sending, rid):
                    united.finished_sending.add(rid)
            for name, blocks in kv.dropped_saves.items():
                united.dropped_saves[name] = united.dropped_saves.get(name, 0) + blocks
            for name, (saved, loaded) in kv.transferred.items():
                had = united.transferred.get(name, (0, 0))
                united.transferred[name] = (had[0] + saved, had[1] + loaded)
        result = outputs[output_rank]
        result.kv_connector_output = united
        return result

    def _count(self, reported: dict[str, int], rid: str) -> bool:
        """One more rank reported `rid`; whether that was the last."""
        reported[rid] = reported.get(rid, 0) + 1
        if reported[rid] < self.world_size:
            return False
        del reported[rid]
        return True
