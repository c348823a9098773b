"""The scheduler driven step by step with a fake runner that samples tokens we choose."""

from __future__ import annotations

from typing import Callable

import pytest

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.kv_cache_groups import KVCacheGroups
from treadle.core.scheduler import Scheduler
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams

EOS = 2
BS = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=64, chunked=True, policy="fcfs",
                   max_model_len=256, caching=True, window=None, reach=None) -> Scheduler:
    """`window`: every layer's sliding window (blocks behind it are given back); a tuple: each
    KV cache group's (core/kv_cache_groups.py). `reach`: config.window_reach, which bounds
    (and asserts) what a windowed group holds."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        scheduling_policy=policy, enable_chunked_prefill=chunked),
        CacheConfig(block_size=BS, enable_prefix_caching=caching, kv_groups=groups_of(window)),
        num_blocks=num_blocks, max_model_len=max_model_len, window_reach=reach)


def groups_of(window: int | None | tuple) -> KVCacheGroups:
    """KV cache groups with these windows, a layer each."""
    windows = window if isinstance(window, tuple) else (window,)
    return KVCacheGroups(windows, tuple(range(len(windows))), (0,) * len(windows))


def make_request(rid: str, prompt_len: int, *, first_token: int = 100, priority: int = 0,
                 arrival: float = 0.0, **params) -> Request:
    params.setdefault("max_tokens", 8)
    sp = SamplingParams(**params)
    r = Request(rid, list(range(first_token, first_token + prompt_len)), sp, eos_token_id=EOS,
                arrival_time=arrival, priority=priority, block_size=BS)
    r.max_tokens = sp.max_tokens
    return r


class FakeRunner:
    """Samples `next_token(request)` for every request whose known tokens are all computed."""

    def __init__(self, sched: Scheduler, next_token: Callable[[Request], int] | None = None):
        self.sched = sched
        self.next_token = next_token or (lambda r: 1000 + r.num_output_tokens)
        self.history: list[SchedulerOutput] = []

    def step(self):
        so = self.sched.schedule()
        self.history.append(so)
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            r = self.sched.requests[rid]
            ids.append(rid)
            sampled.append([self.next_token(r)] if r.num_computed_tokens == r.num_tokens else [])
        return self.sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))

    def run(self, max_steps: int = 1000) -> dict[str, list]:
        finished = {}
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            for out in self.step():
                if out.finish_reason:
                    finished[out.request_id] = out
        assert not self.sched.has_unfinished_requests()
        self.sched.kv_cache.assert_no_leaks()
        return finished


def run_one(tokens: list[int], **params):
    sched = make_scheduler()
    r = make_request("r", 5, **params)
    sched.add_request(r)
    stream = iter(tokens)
    FakeRunner(sched, lambda req: next(stream)).run()
    return r


def test_eos_stops_with_reason_stop():
    r = run_one([7, 8, EOS, 9], max_tokens=8)
    assert r.output_token_ids == [7, 8, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_stop_token_id_sets_stop_reason():
    r = run_one([7, 55, 9], stop_token_ids=[55])
    assert r.output_token_ids == [7, 55] and r.stop_reason == 55
    assert r.status.finish_reason == "stop"


def test_max_tokens_gives_length():
    r = run_one(list(range(10, 30)), max_tokens=5)
    assert r.output_token_ids == [10, 11, 12, 13, 14]
    assert r.status.finish_reason == "length"


def test_eos_on_the_last_allowed_token_is_a_stop():
    r = run_one([7, EOS], max_tokens=2)
    assert r.status.finish_reason == "stop"


def test_min_tokens_defers_eos_and_stop_tokens():
    r = run_one([EOS, 55, EOS, 7], min_tokens=3, stop_token_ids=[55], max_tokens=8)
    assert r.output_token_ids == [EOS, 55, EOS]
    assert r.status.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens():
    r = run_one([EOS] * 6, ignore_eos=True, max_tokens=4)
    assert r.output_token_ids == [EOS] * 4 and r.status.finish_reason == "length"


def test_prefill_is_chunked_and_mixed_with_decodes():
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 6))
    runner.step()                                  # a: whole prompt
    sched.add_request(make_request("b", 40, first_token=300))
    runner.step()
    so = runner.history[-1]
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}   # a decode beside b's first chunk
    runner.step()
    assert runner.history[-1].num_scheduled_tokens == {"a": 1, "b": 15}
    runner.run()


def test_fcfs_without_chunking_never_lets_a_short_request_skip_ahead():
    sched = make_scheduler(budget=64, chunked=False, max_model_len=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("run1", 10, max_tokens=20))
    sched.add_request(make_request("run2", 10, first_token=200, max_tokens=20))
    runner.step()
    sched.add_request(make_request("long", 63, first_token=300, max_tokens=1))
    sched.add_request(make_request("short", 3, first_token=600))
    runner.step()
    # 63 tokens do not fit beside two decodes (2 + 63 > 64); "short" would, but must wait.
    assert set(runner.history[-1].num_scheduled_tokens) == {"run1", "run2"}
    runner.run()
    order = [list(so.num_scheduled_tokens) for so in runner.history]
    first_long = next(i for i, ids in enumerate(order) if "long" in ids)
    first_short = next(i for i, ids in enumerate(order) if "short" in ids)
    assert first_long <= first_short
    assert all(so.num_scheduled_tokens.get("long", 63) == 63 for so in runner.history)


def test_fcfs_preempts_the_latest_arrival_and_it_resumes_with_a_prefix_hit():
    sched = make_scheduler(num_blocks=9, budget=64)       # 8 usable blocks of 4
    runner = FakeRunner(sched)
    sched.add_request(make_request("old", 8, max_tokens=16, arrival=0.0))
    sched.add_request(make_request("new", 8, first_token=300, max_tokens=16, arrival=1.0))
    preempted_at = None
    for step in range(40):
        runner.step()
        if sched.num_preemptions and preempted_at is None:
            preempted_at = step
            assert sched.requests["new"].status == RequestStatus.PREEMPTED
            assert sched.requests["old"].status == RequestStatus.RUNNING
            assert sched.waiting.peek().request_id == "new"
        if not sched.has_unfinished_requests():
            break
    assert preempted_at is not None
    new_resumed = [so for so in runner.history[preempted_at + 1:]
                   if any(n.req_id == "new" for n in so.scheduled_new_reqs)]
    assert new_resumed, "the preempted request never came back"
    resumed = next(n for n in new_resumed[0].scheduled_new_reqs if n.req_id == "new")
    assert resumed.num_computed_tokens > 0            # its surviving blocks were prefix hits
    assert len(resumed.token_ids) > 8                 # outputs so far are recomputed, not lost
    runner.run()


def test_blocks_filled_by_decoding_are_published_as_they_fill():
    """Outputs enter the prefix cache a block at a time: a decode step that needs no new block
    still publishes the block it completes (the allocator's fast path), and a later request
    whose prompt is the prompt and those outputs hits every full block."""
    sched = make_scheduler()
    runner = FakeRunner(sched)
    first = make_request("first", 4, max_tokens=13)
    sched.add_request(first)
    published = []
    while sched.has_unfinished_requests():
        runner.step()
        if not first.is_finished:
            assert sched.kv_cache.num_published_blocks(first) == first.num_computed_tokens // BS
            published.append(sched.kv_cache.num_published_blocks(first))
    assert sorted(set(published)) == [1, 2, 3]   # the 4th fills in its last step
    # Its 16 computed tokens are 4 blocks, freed now and cached: a prompt of them and one more
    # token hits all 4.
    tokens = list(range(100, 104)) + [1000 + i for i in range(12)]
    again = Request("again", tokens + [7], SamplingParams(max_tokens=1), eos_token_id=EOS,
                    block_size=BS)
    sched.add_request(again)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=9, budget=64, policy="priority", max_num_seqs=2)
    runner = FakeRunner(sched)
    low = make_request("low", 8, priority=5, arrival=0.0, max_tokens=16)
    high = make_request("high", 8, first_token=300, priority=0, arrival=1.0, max_tokens=16)
    mid = make_request("mid", 4, first_token=600, priority=1, arrival=2.0, max_tokens=2)
    for r in (low, high, mid):
        sched.add_request(r)
    runner.step()
    assert set(runner.history[0].num_scheduled_tokens) == {"high", "mid"}
    finished = runner.run()
    assert set(finished) == {"low", "high", "mid"}
    # low and high together need 12 blocks of the 8: the lower priority one gives way.
    assert low.num_preemptions > 0 and high.num_preemptions == 0


def test_prompt_that_cannot_fit_is_rejected_at_add():
    sched = make_scheduler(num_blocks=5, max_model_len=256)   # 4 usable blocks = 16 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("big", 20))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_model_len=10).add_request(make_request("long", 10))
    assert not sched.has_unfinished_requests()
    sched.kv_cache.assert_no_leaks()


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x", 4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 4))


@pytest.mark.parametrize("abort_at", range(6))
def test_abort_at_any_step_frees_everything(abort_at):
    sched = make_scheduler(budget=8)
    runner = FakeRunner(sched)
    r = make_request("r", 12, max_tokens=10)
    sched.add_request(r)
    for _ in range(abort_at):
        runner.step()
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert r.status.finish_reason == "abort"
    # 12 prompt tokens take 2 steps at 8 per step; each later step adds one token.
    assert r.num_output_tokens == max(0, abort_at - 1)
    runner.run()
    # The workers are told to drop its slot with the next step that reaches them.
    sched.add_request(make_request("next", 3, first_token=700))
    assert "r" in sched.schedule().finished_req_ids


def test_an_empty_async_step_keeps_the_ids_the_workers_must_drop():
    # Empty steps never reach the workers, so they must not swallow finished ids.
    sched = make_scheduler()
    sched.add_request(make_request("A", 4, max_tokens=2))
    sched.add_request(make_request("B", 4, first_token=300, max_tokens=5))
    s1 = sched.schedule()                       # both prefill
    s2 = sched.schedule()                       # both decode, S1 still in flight
    sched.update_from_output(s1, ModelRunnerOutput(req_ids=["A", "B"], sampled_token_ids=[[7], [EOS]]))
    s3 = sched.schedule()                       # A's in-flight output reaches max_tokens: nothing
    assert s3.is_empty and not s3.finished_req_ids
    sched.update_from_output(s2, ModelRunnerOutput(req_ids=["A", "B"], sampled_token_ids=[[8], [9]]))
    sched.add_request(make_request("C", 4, first_token=500))
    assert {"A", "B"} <= sched.schedule().finished_req_ids
