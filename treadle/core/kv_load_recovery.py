"""Settling the KV loads of a returned step: publish what loaded, recover from what did not.

From the first block a connector loads for a request, nothing of that request is published to
the prefix cache until the step that loads it has returned with no load error for it: not the
loaded blocks, nor the blocks it computes on top of them, in that step or in later ones already
in flight. So no other request can ever read KV that depends on a block that never arrived,
even if the loader is aborted first; the only reader is the loader itself. The rule, one for
every load:

- the request keeps the tokens it really had before the failed block: its blocks before it
  (hits and good loads) are published, nothing from the failed block on ever is;
- policy "recompute": the request is reset as a preemption would reset it. Output of the failed
  step and of any step scheduled on top of it (async scheduling) is stale and dropped by count,
  the workers drop its slot, and it resumes with a prefix hit on the good blocks: it recomputes
  from the start of the first bad block and is not offered external KV again;
- policy "fail": the request ends with finish_reason "error"; nothing it held is shared.

The loads of a step are recorded in that step's own SchedulerOutput (`kv_loads`), so under
async scheduling a later step already in flight changes nothing about which blocks failed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from treadle.request import RequestStatus

if TYPE_CHECKING:
    from treadle.core.scheduler import EngineCoreOutput, Scheduler
    from treadle.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def settle_kv_loads(scheduler: Scheduler, sched_out: SchedulerOutput, invalid_block_ids: set[int],
                    policy: str) -> list[EngineCoreOutput]:
    """Publishes the step's good loads and applies `policy` to requests with a failed one;
    returns the final outputs of requests it ended."""
    from treadle.core.scheduler import EngineCoreOutput

    kv_cache = scheduler.kv_cache
    ended: list[EngineCoreOutput] = []
    for rid, (first, block_ids, tenancy) in sched_out.kv_loads.items():
        request = scheduler.requests.get(rid)
        if request is None or request.num_preemptions != tenancy:
            continue   # finished or reset since: nothing it holds now came from this load
        bad = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
        first_bad = None if bad is None else first + bad
        kv_cache.settle_loaded(request, first_bad)
        if first_bad is None:
            continue
        message = (f"request {rid}: KV block {first_bad} (of the blocks loaded from "
                   f"{first} on) failed to load")
        if policy == "recompute":
            logger.warning("%s; recomputing from token %d", message,
                           first_bad * scheduler.block_size)
            assert request.status == RequestStatus.RUNNING, f"{rid} is {request.status.name}"
            scheduler.preempt(request)
            request.kv_load_failed = True
            if not request.output_token_ids:
                request.num_cached_tokens = -1   # measured again when it is scheduled
        else:
            logger.error("%s; ending it (kv_load_failure_policy='fail')", message)
            scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)
            ended.append(EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error",
                                          stop_reason=message))
    return ended
