"""Starting a waiting request: its prefix-cache hit, the KV a connector loads for it, and
its first chunk. A step of `Scheduler.schedule`, kept in a file of its own for its size."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from treadle.request import Request, RequestStatus

if TYPE_CHECKING:
    from treadle.config import SchedulerConfig
    from treadle.core.kv_cache_manager import KVCacheManager
    from treadle.core.waiting_queue import WaitingQueue
    from treadle.kv_transfer.base import KVConnectorBase


class AdmittingScheduler(Protocol):
    """What admission reads and changes of the scheduler."""

    config: SchedulerConfig
    connector: KVConnectorBase | None
    kv_cache: KVCacheManager
    block_size: int
    waiting: WaitingQueue
    running: list[Request]
    loaded: list[Request]
    loading: dict[str, tuple[int, list[int], int]]


# admit's answer when the connector cannot tell yet what it can load for the request.
ASK_AGAIN = -1


def admit(scheduler: AdmittingScheduler, request: Request, budget: int, num_scheduled: dict[str, int],
          kv_loads: dict, async_loads: dict) -> int | None:
    """Start the next waiting request: give it its first chunk, after a prefix-cache hit
    and whatever KV a connector loads for it. With an asynchronous load it takes the blocks
    of its whole prompt and waits for the load instead (returns 0). Returns the tokens it
    takes from the budget, None when it cannot start now, or ASK_AGAIN when the connector
    cannot tell yet."""
    rid = request.request_id
    returning = bool(scheduler.loaded) and request is scheduler.loaded[0]
    hit_blocks, num_hit, num_external, load_async = [], 0, 0, False
    if not returning:
        hit_blocks, num_hit = scheduler.kv_cache.get_computed_blocks(request)
        # A request that skips the local prefix cache (prompt logprobs) computes its whole
        # prompt: KV from outside would leave those positions' logprobs uncomputed too.
        if (scheduler.connector is not None and not request.kv_load_failed
                and not request.skip_reading_prefix_cache):
            num_external, load_async = scheduler.connector.get_num_new_matched_tokens(request, num_hit)
            if num_external is None:
                return ASK_AGAIN
    load_async = load_async and num_external > 0
    num_computed = request.num_computed_tokens if returning else num_hit + num_external
    num_new = request.num_tokens - num_computed
    if not load_async:
        if not scheduler.config.enable_chunked_prefill and num_new > budget:
            return None  # no chunking: wait for room rather than let a later one skip ahead
        num_new = min(num_new, budget)
    if scheduler.kv_cache.allocate_slots(request, num_external + num_new, hit_blocks, num_hit,
                                         num_external) is None:
        return None
    if returning:
        scheduler.loaded.pop(0)
    else:
        scheduler.waiting.pop()
        scheduler.kv_cache.record_prefix_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit
        if scheduler.connector is not None:
            block_ids = scheduler.kv_cache.get_connector_block_ids(rid)
            scheduler.connector.update_state_after_alloc(request, block_ids, num_external)
            first = num_hit // scheduler.block_size
            load = (first, block_ids[first:first + num_external // scheduler.block_size],
                    request.tenancy)
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                scheduler.loading[rid] = async_loads[rid] = load
                return 0
            if num_external:
                kv_loads[rid] = load
            request.num_computed_tokens += num_external
    request.status = RequestStatus.RUNNING
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = request.num_computed_tokens
        request.queue_time = time.monotonic() - request.arrival_time
    scheduler.running.append(request)
    num_scheduled[rid] = num_new
    return num_new
