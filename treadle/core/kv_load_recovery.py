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

An asynchronous load follows the same rule. Its request waits (WAITING_FOR_REMOTE_KVS) with
the blocks of its whole prompt and computes nothing until the workers report the load done;
then it is ready to start (`Scheduler.loaded`, ahead of the waiting queue, so requests holding
blocks never wait behind requests that need them), counting the tokens it really has, up to
its first bad block (or it ends, with "fail"). A request that ends while its load still writes
into its blocks keeps them until the load is done.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from treadle.core.scheduler_output import EngineCoreOutput
from treadle.request import RequestStatus

if TYPE_CHECKING:
    from treadle.core.kv_cache_manager import KVCacheManager
    from treadle.request import Request

logger = logging.getLogger(__name__)


class LoadingScheduler(Protocol):
    """What settling loads reads and changes of the scheduler."""

    requests: dict[str, Request]
    kv_cache: KVCacheManager
    kv_load_failure_policy: str
    block_size: int
    loading: dict[str, tuple[int, list[int], int]]
    loaded: list[Request]
    free_after_load: dict[str, tuple[Request, bool]]
    sending: dict[str, Request]

    def preempt(self, request: Request) -> None: ...

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> None: ...


def settle_kv_loads(scheduler: LoadingScheduler, loads: dict[str, tuple[int, list[int], int]],
                    invalid_block_ids: set[int]) -> list[EngineCoreOutput]:
    """Settles a returned step's synchronous loads; returns the final outputs of requests it
    ended."""
    ended: list[EngineCoreOutput] = []
    for rid, (first, block_ids, tenancy) in loads.items():
        request = scheduler.requests.get(rid)
        if request is None or request.tenancy != tenancy:
            # Finished or reset since, maybe with its id taken by a new request: nothing the
            # request of that id holds now came from this load.
            continue
        first_bad = _first_bad(first, block_ids, invalid_block_ids)
        scheduler.kv_cache.settle_loaded(request, first_bad)
        if first_bad is None:
            continue
        message = _failure(scheduler, request, first, first_bad)
        if scheduler.kv_load_failure_policy == "recompute":
            assert request.status == RequestStatus.RUNNING, f"{rid} is {request.status.name}"
            scheduler.preempt(request)
            if not request.output_token_ids:
                request.num_cached_tokens = -1   # measured again when it is scheduled
        else:
            ended.append(_end_with_error(scheduler, request, message))
    return ended


def settle_async_load(scheduler: LoadingScheduler, rid: str, invalid_block_ids: set[int]
                      ) -> list[EngineCoreOutput]:
    """An asynchronous load reported done: the request goes back to the waiting queue with the
    tokens it really has, or ends (policy "fail"); returns its final output if it ended."""
    aborted, delay_free = scheduler.free_after_load.pop(rid, (None, False))
    if aborted is not None:   # it ended while its load wrote into its blocks
        if delay_free:   # the connector still reads them: freed when it reports them sent
            scheduler.sending[rid] = aborted
        else:
            scheduler.kv_cache.free(aborted)
        return []
    first, block_ids, tenancy = scheduler.loading.pop(rid)
    request = scheduler.requests[rid]
    # An id is never reused while its load runs (Scheduler.check_request), nor is a loading
    # request preempted: the load is this request's.
    assert request.tenancy == tenancy, f"{rid}: a load of tenancy {tenancy} for {request.tenancy}"
    first_bad = _first_bad(first, block_ids, invalid_block_ids)
    bs = scheduler.block_size
    request.num_computed_tokens = (first + len(block_ids) if first_bad is None else first_bad) * bs
    scheduler.kv_cache.settle_loaded(request, first_bad)
    request.status = RequestStatus.WAITING
    scheduler.loaded.append(request)
    if first_bad is None:
        return []
    message = _failure(scheduler, request, first, first_bad)
    if scheduler.kv_load_failure_policy == "recompute":
        return []   # it keeps its blocks and recomputes from the first bad one
    return [_end_with_error(scheduler, request, message)]


def _first_bad(first: int, block_ids: list[int], invalid_block_ids: set[int]) -> int | None:
    """Index, in its request, of the first loaded block that failed; None if none did."""
    return next((first + i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)


def _failure(scheduler: LoadingScheduler, request: Request, first: int, first_bad: int) -> str:
    """Marks the request (it is not offered external KV again) and logs; returns the message."""
    request.kv_load_failed = True
    message = (f"request {request.client_id}: KV block {first_bad} (of the blocks loaded "
               f"from {first} on) failed to load")
    if scheduler.kv_load_failure_policy == "recompute":
        logger.warning("%s; recomputing from token %d", message, first_bad * scheduler.block_size)
    else:
        logger.error("%s; ending it (kv_load_failure_policy='fail')", message)
    return message


def _end_with_error(scheduler: LoadingScheduler, request: Request, message: str
                    ) -> EngineCoreOutput:
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
    return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                            finish_reason="error", stop_reason=message)
