"""Recovery from failed KV loads, driven step by step: a fake connector offers stored blocks,
the KV oracle of the ledger test loads them (or fails to) and checks every read and every
published block, and the ledger checks every delivered token, sync and async alike."""

from __future__ import annotations

import random
from typing import Callable

import pytest
from hypothesis import given, settings, strategies as st

from tests.test_scheduler import BS, make_request, make_scheduler
from tests.test_token_ledger import AsyncRunner, RequestIds, random_drafts, run_random_events
from treadle.core.scheduler import Scheduler
from treadle.kv_transfer import KVConnectorBase
from treadle.request import Request, RequestStatus


class FakeStore(KVConnectorBase):
    """The scheduler side of a connector whose store holds the blocks of `stored` prompts."""

    def __init__(self, load_async: bool = False, delay_free: bool = False,
                 undecided: Callable[[], bool] | None = None) -> None:
        # No engine config: only the scheduler side is used.
        self.stored: set[bytes] = set()
        self.asked: list[str] = []
        self.load_async = load_async
        self.delay_free = delay_free   # finished requests' blocks are sent after the fact
        # When it says True, the store cannot tell yet ("ask again later": None).
        self.undecided = undecided
        self._weight_version: object = 0

    @property
    def weight_version(self) -> object:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: object) -> None:
        # Stored blocks are named by the weights that computed them: none matches new weights.
        self._weight_version = version
        self.stored.clear()

    def weights_changed(self, weights_identity: str) -> None:
        self.weight_version = weights_identity

    def request_finished(self, request: Request, block_ids: list[int]):
        return self.delay_free, {"blocks": block_ids} if self.delay_free else None

    def store(self, request: Request) -> None:
        self.stored.update(request.block_hashes)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        self.asked.append(request.request_id)
        if self.undecided is not None and self.undecided():
            return None, False
        first, last = num_computed_tokens // BS, (request.num_tokens - 1) // BS
        num = 0
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self.stored:
                break
            num += 1
        return num * BS, self.load_async and num > 0


def connected(policy: str = "recompute", load_async: bool = False, delay_free: bool = False,
              undecided: Callable[[], bool] | None = None, scheduling: str = "fcfs",
              **kw) -> tuple[Scheduler, FakeStore]:
    store = FakeStore(load_async, delay_free, undecided)
    sched = make_scheduler(policy=scheduling, **kw)
    sched.connector, sched.kv_load_failure_policy = store, policy
    return sched, store


def add_stored(runner: AsyncRunner, store: FakeStore, rid: str, prompt_len: int,
               first_token: int, max_tokens: int = 6) -> Request:
    request = make_request(rid, prompt_len, first_token=first_token, max_tokens=max_tokens)
    store.store(request)
    runner.add(request)
    return request


@pytest.mark.parametrize("depth", [1, 2])   # 2: async, a later step is in flight on top
def test_a_failed_load_cuts_back_only_its_request_to_the_first_bad_block(depth):
    sched, store = connected(num_blocks=40)
    runner = AsyncRunner(sched, load_fails=lambda rid, i: (rid, i) == ("a", 2))
    a = add_stored(runner, store, "a", 21, first_token=100)   # blocks 0-4 stored
    b = add_stored(runner, store, "b", 13, first_token=500)   # blocks 0-2 stored
    so = runner.schedule()
    assert so.kv_loads == {"a": (0, so.scheduled_new_reqs[0].block_ids[0][:5], a.tenancy),
                           "b": (0, so.scheduled_new_reqs[1].block_ids[0][:3], b.tenancy)}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}        # only the last token computes
    if depth == 2:
        runner.schedule()                                      # decodes on top of the failed step
        assert a.num_output_placeholders == 2
    runner.complete()
    # a keeps blocks 0-1 (published), is reset, and is not offered external KV again.
    assert a.status == RequestStatus.PREEMPTED and a.kv_load_failed
    # The failed step's token was dropped; one from a step on top of it is still due.
    assert a.num_stale_output_tokens == depth - 1 and runner.delivered["a"] == []
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 13 + depth - 1
    while runner.fifo:
        runner.complete()
    so = runner.schedule()
    readmitted = next(new for new in so.scheduled_new_reqs if new.req_id == "a")
    assert readmitted.num_computed_tokens == 2 * BS and "a" not in so.kv_loads
    assert store.asked.count("a") == 1
    runner.drain(depth)
    runner.check_ledger()


def test_fail_policy_ends_the_request_and_publishes_nothing_bad():
    sched, store = connected("fail", num_blocks=40)
    runner = AsyncRunner(sched, load_fails=lambda rid, i: (rid, i) == ("a", 1))
    a = add_stored(runner, store, "a", 21, first_token=100)
    add_stored(runner, store, "b", 13, first_token=500)
    runner.schedule()
    bad_block = runner.fifo[0].so.kv_loads["a"][1][1]
    outs = runner.complete()
    assert [(o.request_id, o.finish_reason) for o in outs if o.request_id == "a"] == [("a", "error")]
    assert "KV block 1" in outs[0].stop_reason
    assert a.status == RequestStatus.FINISHED_ERROR
    assert all(b.block_hash is None for b in sched.kv_cache.pool.blocks if b.block_id == bad_block)
    # A request with the same prompt loads again (the store is fine) and finishes exactly.
    runner.load_fails = None
    add_stored(runner, store, "a2", 21, first_token=100)
    runner.drain(1)
    runner.check_ledger()


def test_the_same_blocks_loaded_by_two_requests_in_one_step_are_not_shared_until_loaded():
    """Loaded blocks are published only once their load is known to have succeeded: a second
    request with the same prompt loads its own copy, so one's failure cannot reach the other."""
    sched, store = connected(num_blocks=40)
    runner = AsyncRunner(sched, load_fails=lambda rid, i: rid == "x" and i == 0)
    add_stored(runner, store, "x", 13, first_token=100)
    add_stored(runner, store, "y", 13, first_token=100)
    so = runner.schedule()
    x_blocks, y_blocks = so.kv_loads["x"][1], so.kv_loads["y"][1]
    assert len(x_blocks) == len(y_blocks) == 3 and not set(x_blocks) & set(y_blocks)
    runner.complete()
    assert sched.requests["y"].status == RequestStatus.RUNNING
    runner.drain(1)
    runner.check_ledger()


# -- asynchronous loads ---------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
def test_an_async_load_waits_then_starts_from_what_it_loaded(depth):
    sched, store = connected(load_async=True, num_blocks=40)
    runner = AsyncRunner(sched, load_steps=2)
    a = add_stored(runner, store, "a", 21, first_token=100)
    runner.add(make_request("b", 6, first_token=500))          # nothing stored: it runs
    so = runner.schedule()
    assert so.num_scheduled_tokens == {"b": 6} and list(so.async_kv_loads) == ["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 0
    while a.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        runner.pump(depth)
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 5 * BS
    assert sched.loaded == [a]
    so = runner.schedule()
    new = next(n for n in so.scheduled_new_reqs if n.req_id == "a")
    assert (new.num_computed_tokens, so.num_scheduled_tokens["a"]) == (20, 1)
    runner.drain(depth)
    runner.check_ledger()
    assert a.num_cached_tokens == 20


@pytest.mark.parametrize("depth", [1, 2])
def test_a_failed_async_load_leaves_the_request_waiting_cut_back_to_the_bad_block(depth):
    sched, store = connected(load_async=True, num_blocks=40)
    runner = AsyncRunner(sched, load_fails=lambda rid, i: i == 2)
    a = add_stored(runner, store, "a", 21, first_token=100)
    runner.schedule()
    while a.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        runner.pump(depth)
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 2 * BS
    assert a.kv_load_failed and store.asked == ["a"]
    runner.drain(depth)
    runner.check_ledger()
    assert store.asked == ["a"]   # not offered external KV again


def test_a_failed_async_load_under_fail_ends_the_request():
    sched, store = connected("fail", load_async=True, num_blocks=40)
    runner = AsyncRunner(sched, load_fails=lambda rid, i: i == 1)
    add_stored(runner, store, "a", 21, first_token=100)
    runner.drain(1)
    assert runner.finish_reason == {"a": "error"}
    runner.check_ledger()


def test_two_async_loads_that_cannot_both_fit_do_not_deadlock():
    sched, store = connected(load_async=True, num_blocks=9)   # 8 usable blocks of 4
    runner = AsyncRunner(sched)
    a = add_stored(runner, store, "a", 21, first_token=100, max_tokens=3)   # loads 5 blocks
    b = add_stored(runner, store, "b", 21, first_token=500, max_tokens=3)
    runner.schedule()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert b.status == RequestStatus.WAITING and not sched.kv_cache.holds_blocks("b")
    runner.drain(1)
    runner.check_ledger()


@pytest.mark.parametrize("depth", [1, 2])
def test_an_abort_during_an_async_load_frees_the_blocks_once_the_load_is_done(depth):
    sched, store = connected(load_async=True, num_blocks=40)
    runner = AsyncRunner(sched, load_steps=3)
    add_stored(runner, store, "a", 21, first_token=100)
    runner.schedule()
    runner.abort("a")
    # The load still writes into its blocks: they stay held, and the id is not free yet.
    assert sched.kv_cache.holds_blocks("a") and "a" in sched.free_after_load
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5))
    assert sched.has_unfinished_requests()
    runner.drain(depth)
    assert not sched.kv_cache.holds_blocks("a")
    runner.check_ledger()


# -- delayed frees ---------------------------------------------------------------------------------
@pytest.mark.parametrize("abort", [False, True])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_finished_requests_blocks_stay_held_until_they_are_sent(depth, abort):
    sched, _ = connected(delay_free=True, num_blocks=40)
    runner = AsyncRunner(sched, load_steps=3)
    a = make_request("a", 9, max_tokens=2)
    runner.add(a)
    runner.schedule()
    if abort:
        runner.abort("a")
    else:
        while "a" in sched.requests:
            runner.pump(depth)
    assert a.is_finished and a.kv_transfer_params == {"blocks": sched.kv_cache.get_connector_block_ids("a")}
    assert sched.kv_cache.holds_blocks("a") and sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5))
    runner.drain(depth)                  # steps with no tokens hear that the blocks are sent
    assert not sched.kv_cache.holds_blocks("a") and not sched.sending
    runner.check_ledger()


# -- random interleavings of loads, failures, steps, aborts and preemptions ------------------------
# Reused ids, resets, pauses (keep, with and without clear_cache) and weight updates too (see
# run_random_events); the store sometimes cannot tell yet (`undecided`: "ask again later").
# The same with the real SharedStorageConnector: tests/test_kv_interleavings.py.
@settings(deadline=None)
@given(num_blocks=st.integers(10, 24), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([8, 16, 64]), policy=st.sampled_from(["recompute", "fail"]),
       sched_policy=st.sampled_from(["fcfs", "priority"]), load_async=st.booleans(),
       delay_free=st.booleans(), drafts=st.booleans(),
       undecided_rate=st.sampled_from([0.0, 0.0, 0.3]), seed=st.integers(0, 2**32 - 1),
       num_events=st.integers(10, 120))
def test_kv_loads_under_random_interleavings(num_blocks: int, depth: int, budget: int,
                                             policy: str, sched_policy: str, load_async: bool,
                                             delay_free: bool, drafts: bool,
                                             undecided_rate: float, seed: int, num_events: int):
    rng = random.Random(seed)
    sched, store = connected(policy, load_async, delay_free,
                             undecided=lambda: rng.random() < undecided_rate,
                             num_blocks=num_blocks, budget=budget, scheduling=sched_policy)
    fail_rate = rng.choice([0.0, 0.2, 0.5])
    runner = AsyncRunner(sched, random_drafts(random.Random(seed + 1)) if drafts else None,
                         load_fails=lambda rid, i: rng.random() < fail_rate,
                         load_steps=rng.randint(1, 4))
    ids = RequestIds(runner, rng)

    def add() -> None:
        max_tokens = rng.randint(1, 8)
        prompt_len = min(rng.randint(1, 30), (num_blocks - 1) * BS - max_tokens)
        request = make_request(ids.next(), prompt_len, first_token=rng.choice((100, 300, 500)),
                               max_tokens=max_tokens, priority=rng.randint(0, 5),
                               arrival=float(len(runner.requests)))
        if rng.random() < 0.7:
            store.store(request)
        ids.add(request)

    for _ in range(rng.randint(1, 6)):
        add()
    run_random_events(runner, rng, num_events, depth, add, add_weight=20)
