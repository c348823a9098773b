"""Two rules of asynchronous KV loads, step by step on the scheduler: a request back from its load
starts even in a step that had to preempt, and a request aborted during its load keeps its
blocks until the load is done and then until the connector has sent them."""

from __future__ import annotations

import pytest

from tests.test_kv_load_recovery import add_stored, connected
from tests.test_scheduler import make_request
from tests.test_token_ledger import AsyncRunner


def test_a_loaded_request_starts_in_a_step_that_preempts():
    """Sync, a full cache: B has loaded and holds its prompt's blocks; A, the only running
    request, must preempt itself for one more block. B used to wait behind the preemption, the
    step was empty with nothing in flight, and the engine raised "no progress"."""
    sched, store = connected(load_async=True, num_blocks=8)   # 7 usable blocks of 4
    runner = AsyncRunner(sched, load_steps=1)
    add_stored(runner, store, "B", 17, first_token=500)       # loads 4 blocks, holds 5
    runner.add(make_request("A", 8, first_token=100, max_tokens=6))   # 2 blocks, then a third
    so = runner.schedule()
    assert so.async_kv_loads.keys() == {"B"} and so.num_scheduled_tokens == {"A": 8}
    assert sched.kv_cache.num_free_blocks == 0
    runner.complete()                                          # B's load is done with it
    assert [r.request_id for r in sched.loaded] == ["B"]
    so = runner.schedule()
    assert sched.requests["A"].num_preemptions == 1
    assert so.num_scheduled_tokens == {"B": 1}, "B holds its blocks and must start"
    runner.complete()
    runner.drain(1)
    runner.check_ledger()


@pytest.mark.parametrize("depth", [1, 2])
def test_an_abort_during_a_load_waits_for_the_load_and_then_for_the_send(depth):
    sched, store = connected(load_async=True, delay_free=True, num_blocks=40)
    runner = AsyncRunner(sched, load_steps=2)
    add_stored(runner, store, "a", 21, first_token=100)
    runner.schedule()
    runner.abort("a")
    assert "a" in sched.free_after_load
    while "a" in sched.free_after_load:
        runner.pump(depth)
    # The load is done, but the connector asked to free the blocks late: they stay held.
    assert "a" in sched.sending and sched.kv_cache.holds_blocks("a")
    runner.drain(depth)
    assert not sched.kv_cache.holds_blocks("a")
    runner.check_ledger()


@pytest.mark.parametrize("depth", [1, 2])
def test_a_weight_change_waits_for_a_load_and_drops_what_it_loaded(depth):
    """A load started under the old weights lands KV of the old weights: after the change the
    request must compute its prompt anew, not start on top of that KV (the oracle's keys carry
    the weights' generation, so a read of the old KV fails)."""
    sched, store = connected(load_async=True, num_blocks=40)
    runner = AsyncRunner(sched, load_steps=3)
    a = add_stored(runner, store, "a", 21, first_token=100)
    runner.schedule()
    assert "a" in sched.loading
    runner.update_weights()
    assert not sched.loading and not sched.loaded and a.num_computed_tokens == 0
    assert not sched.kv_cache.holds_blocks("a")
    store.stored.clear()   # the store's blocks are of the old weights
    runner.drain(depth)
    runner.check_ledger()
