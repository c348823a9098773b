"""The async-scheduling token ledger: every output token arrives exactly once, in order.

The fake runner samples, for request `rid` at sequence position `p`, the token `target(rid, p)`.
Since that is a pure function of the position, a token dropped, duplicated or delivered at the
wrong position (stale output not dropped after a preemption or reset, an off-by-one in the
placeholder count, a rejected draft not taken back) makes a request's delivered tokens differ
from `expected(request)`. Steps return in FIFO order, as the engine guarantees.
"""

from __future__ import annotations

import random
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import given, settings, strategies as st

from tests.test_scheduler import BS, EOS, make_request, make_scheduler
from treadle.core.scheduler import EngineCoreOutput, Scheduler
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.kv_transfer import KVConnectorOutput
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams

# Above every target() for positions < max_model_len (256): a draft that is never accepted.
WRONG_DRAFT = 9000


def target(rid: str, pos: int) -> int:
    """The token the fake model samples for `rid` at position `pos`: distinct per position."""
    return 1000 + (zlib.crc32(rid.encode()) % 997) * 7 + pos


# A target is never EOS (no early stop) and never WRONG_DRAFT.
assert target("any", 0) != EOS and 1000 + 996 * 7 + 256 < WRONG_DRAFT


def expected(request: Request, n: int) -> list[int]:
    return [target(request.request_id, request.num_prompt_tokens + i) for i in range(n)]


# (rid, position the drafts would start at) -> drafts to propose, possibly none.
Proposer = Callable[[str, int], list[int]]


def perfect_drafts(k: int) -> Proposer:
    return lambda rid, pos: [target(rid, pos + j) for j in range(k)]


def random_drafts(rng: random.Random) -> Proposer:
    """Half the time 1..4 drafts, each right with probability 0.7."""
    def propose(rid: str, pos: int) -> list[int]:
        if rng.random() < 0.5:
            return []
        return [target(rid, pos + j) if rng.random() < 0.7 else WRONG_DRAFT + j
                for j in range(rng.randint(1, 4))]
    return propose


POISON = object()   # KV computed on top of a block that failed to load


class KVOracle:
    """What every KV slot holds, as a fake worker would write it: the publishing invariant's test.

    Steps run in the order they are scheduled, so each is "executed" when it is scheduled: it
    writes its new tokens' slots, then every scheduled request reads all of its context. A slot
    holds a key for the whole token prefix ending at it, so a read of a slot never written, or
    written for other tokens (a block published and then taken back, a rejected draft, a block
    reused after eviction), fails at once.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}          # the workers' block table per request
        self.slots: dict[tuple[int, int], int] = {}     # (block, offset) -> prefix key
        # Requests whose KV load failed, until the workers drop their slot: every step of
        # theirs until then reads the missing block and computes poison.
        self.poisoned: set[str] = set()

    def run_step(self, so: SchedulerOutput, input_tokens: Callable[[str, int, list[int]], list[int]],
                 load_fails: Callable[[str, int], bool] | None = None) -> set[int]:
        """`input_tokens(rid, end, drafts)`: the request's tokens at positions [0, end).

        The step's KV loads (`so.kv_loads`) land first, except blocks `load_fails(rid, index)`
        picks: those keep whatever they held, and what their request computes on top of them
        is poison. Returns the ids of the blocks that failed to load."""
        invalid: set[int] = set()
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.poisoned.discard(rid)
        start: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
            start[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
            self.tables[rid] += blocks
            start[rid] = num_computed
        keys: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            end = start[rid] + n
            key, keys[rid] = 0, []
            for tok in input_tokens(rid, end, so.scheduled_spec_decode_tokens.get(rid, [])):
                key = hash((key, tok))
                keys[rid].append(key)
        for rid, (first, block_ids, _) in so.kv_loads.items():
            for i, block in enumerate(block_ids, start=first):
                if load_fails is not None and load_fails(rid, i):
                    invalid.add(block)
                    self.poisoned.add(rid)
                    continue
                for offset in range(self.block_size):
                    self.slots[(block, offset)] = keys[rid][i * self.block_size + offset]
        for rid, n in so.num_scheduled_tokens.items():
            for pos in range(start[rid], start[rid] + n):   # every write lands before any read
                self.slots[self._slot(rid, pos)] = POISON if rid in self.poisoned else keys[rid][pos]
        for rid, prefix_keys in keys.items():
            if rid in self.poisoned:
                continue   # it reads a block that never arrived: its steps are recovered from
            for pos, key in enumerate(prefix_keys):
                assert self.slots.get(self._slot(rid, pos)) == key, (
                    f"{rid} reads position {pos} from block {self._slot(rid, pos)[0]}, "
                    "which does not hold its KV")
        return invalid

    def load(self, rid: str, first: int, block_ids: list[int],
             input_tokens: Callable[[str, int, list[int]], list[int]],
             load_fails: Callable[[str, int], bool] | None) -> set[int]:
        """An asynchronous load lands; returns the blocks that failed (left as they were)."""
        key, keys = 0, []
        for tok in input_tokens(rid, (first + len(block_ids)) * self.block_size, []):
            key = hash((key, tok))
            keys.append(key)
        invalid = set()
        for i, block in enumerate(block_ids, start=first):
            if load_fails is not None and load_fails(rid, i):
                invalid.add(block)
                continue
            for offset in range(self.block_size):
                self.slots[(block, offset)] = keys[i * self.block_size + offset]
        return invalid

    def check_published(self, hash_to_block: dict, tokens_of: dict[bytes, list[int]],
                        exempt: set[int] = frozenset()) -> None:
        """Every block in the prefix cache holds the KV of the tokens its hash stands for,
        except `exempt` ones: blocks whose load failed in a step that has not returned yet,
        which the scheduler withdraws when it does (nothing can reach them before)."""
        for block_hash, block in hash_to_block.items():
            if block.block_id in exempt:
                continue
            key, keys = 0, []
            for tok in tokens_of[block_hash]:
                key = hash((key, tok))
                keys.append(key)
            for offset, key in enumerate(keys[-self.block_size:]):
                assert self.slots.get((block.block_id, offset)) == key, (
                    f"block {block.block_id} is published, but slot {offset} does not hold its KV")

    def _slot(self, rid: str, pos: int) -> tuple[int, int]:
        return self.tables[rid][pos // self.block_size], pos % self.block_size


@dataclass
class InFlightStep:
    so: SchedulerOutput
    first_pos: dict[str, int]   # rid -> position of the first token this step samples for it
    invalid_block_ids: set[int] = field(default_factory=set)   # its KV loads that failed


class AsyncRunner:
    """Drives the scheduler like the async engine: steps are scheduled ahead, returned in order."""

    def __init__(self, sched: Scheduler, propose: Proposer | None = None,
                 load_fails: Callable[[str, int], bool] | None = None,
                 load_steps: int = 2) -> None:
        self.sched = sched
        self.propose = propose
        self.load_fails = load_fails   # (rid, block index) -> whether that KV load fails
        # Asynchronous KV loads finish `load_steps` returned steps after they start.
        self.load_steps = load_steps
        self.loading: dict[str, list] = {}   # rid -> [(first block, block ids, tenancy), steps left]
        self.sending: dict[str, int] = {}    # rid -> steps left until its blocks are sent
        self.fifo: deque[InFlightStep] = deque()
        self.requests: dict[str, Request] = {}     # every request ever added, finished or not
        self.delivered: dict[str, list[int]] = defaultdict(list)
        self.finish_reason: dict[str, str] = {}
        self.at_abort: dict[str, list[int]] = {}   # what had been delivered when it was aborted
        self.scheduled_tokens: dict[str, int] = defaultdict(int)
        self.kv = KVOracle(sched.block_size)
        self.tokens_of_hash: dict[bytes, list[int]] = {}   # every block hash seen -> its tokens

    # -- engine actions ----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.sched.add_request(request)
        self.requests[request.request_id] = request

    def schedule(self, poll: bool = False) -> SchedulerOutput:
        """A step; with `poll`, the step with no tokens the engine uses to wait for loads."""
        so = self.sched.poll_kv_loads() if poll else self.sched.schedule()
        for rid in so.scheduled_spec_decode_tokens:
            # Drafts follow the last known token, so nothing may be in flight ahead of them.
            assert self.in_fifo(rid) == 0, f"{rid}: drafts scheduled with output in flight"
        # Read right after schedule(): num_computed_tokens already counts this step's tokens,
        # drafts included, and the first sample follows the last non-draft token.
        first_pos = {rid: self.sched.requests[rid].num_computed_tokens
                     - len(so.scheduled_spec_decode_tokens.get(rid, ()))
                     for rid in so.num_in_flight_tokens}
        for rid, n in so.num_scheduled_tokens.items():
            self.scheduled_tokens[rid] += n
        invalid = self.kv.run_step(so, self.input_tokens, self.load_fails)
        self.fifo.append(InFlightStep(so, first_pos, invalid))
        for rid, load in so.async_kv_loads.items():
            self.loading[rid] = [load, self.load_steps]
        self.check_published()
        self.check_in_flight()
        return so

    def check_published(self) -> None:
        for r in self.sched.requests.values():
            for i in range(len(r.block_hashes)):
                self.tokens_of_hash.setdefault(r.block_hashes[i], r.all_token_ids[:(i + 1) * BS])
        # Requests with a failed load in a step not yet returned, and every block they hold.
        failing = {rid for step in self.fifo for rid, (_, ids, _) in step.so.kv_loads.items()
                   if step.invalid_block_ids & set(ids)}
        exempt = {b for rid in failing for b in self.sched.kv_cache.get_block_ids(rid)}
        self.kv.check_published(self.sched.kv_cache.pool.hash_to_block, self.tokens_of_hash, exempt)

    def finish_async_loads(self) -> tuple[set[str], set[int]]:
        """Asynchronous loads due with this returned step: they write their blocks (but the
        failing ones); returns the requests done and the blocks that failed."""
        done, invalid = set(), set()
        for rid, entry in list(self.loading.items()):
            entry[1] -= 1
            if entry[1] > 0:
                continue
            (first, block_ids, _), _ = entry
            del self.loading[rid]
            done.add(rid)
            invalid |= self.kv.load(rid, first, block_ids, self.input_tokens, self.load_fails)
        return done, invalid

    def finish_sends(self) -> set[str]:
        """Finished requests whose blocks the connector kept (delayed frees) are sent
        `load_steps` returned steps after they finished."""
        for rid in self.sched.sending:
            self.sending.setdefault(rid, self.load_steps)
        done = set()
        for rid in list(self.sending):
            self.sending[rid] -= 1
            if self.sending[rid] <= 0:
                del self.sending[rid]
                done.add(rid)
        return done

    def input_tokens(self, rid: str, end: int, drafts: list[int]) -> list[int]:
        """A step's input: the prompt, the outputs (known or in flight), then its drafts."""
        prompt = self.requests[rid].prompt_token_ids
        known = end - len(drafts)
        return (prompt[:known] + [target(rid, p) for p in range(len(prompt), known)]
                + list(drafts))

    def complete(self) -> list[EngineCoreOutput]:
        step = self.fifo.popleft()
        so = step.so
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        proposals: dict[str, list[int]] = {}
        for rid in req_ids:
            if rid not in step.first_pos:
                sampled.append([])   # a prefill chunk that is not the last samples nothing
                continue
            p = step.first_pos[rid]
            tokens: list[int] = []
            for j, draft in enumerate(so.scheduled_spec_decode_tokens.get(rid, ())):
                if draft != target(rid, p + j):
                    break
                tokens.append(draft)
            tokens.append(target(rid, p + len(tokens)))   # the bonus token
            sampled.append(tokens)
            if self.propose is not None and (drafts := self.propose(rid, p + len(tokens))):
                proposals[rid] = drafts
        recved, invalid = self.finish_async_loads()
        sent = self.finish_sends()
        outs = self.sched.update_from_output(
            so, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                  draft_token_ids=proposals,
                                  kv_connector_output=KVConnectorOutput(
                                      finished_sending=sent, finished_recving=recved,
                                      invalid_block_ids=step.invalid_block_ids | invalid)))
        for out in outs:
            assert out.request_id not in self.finish_reason, f"{out.request_id}: output after finishing"
            self.delivered[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reason[out.request_id] = out.finish_reason
        self.check_published()
        self.check_in_flight()
        return outs

    def reset(self) -> bool:
        if self.sched.num_kv_transfers():   # as EngineCore does: steps in flight, then transfers
            while self.fifo:
                self.complete()
            while self.sched.num_kv_transfers():
                self.schedule(poll=True)
                self.complete()
        ok = self.sched.reset_prefix_cache(reset_running_requests=True)
        self.check_in_flight()
        return ok

    def abort(self, rid: str) -> None:
        assert rid in self.sched.requests, f"{rid} is not live"
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.at_abort[rid] = list(self.delivered[rid])
        self.check_in_flight()

    def pump(self, depth: int) -> None:
        """One engine-loop event: schedule while fewer than `depth` steps are out, else complete."""
        if len(self.fifo) < depth and self.sched.has_unfinished_requests():
            self.schedule()
        else:
            self.complete()

    def drain(self, depth: int, max_events: int = 2000) -> None:
        for _ in range(max_events):
            if not self.sched.has_unfinished_requests() and not self.fifo:
                return
            self.pump(depth)
        raise AssertionError(f"no progress after {max_events} events: "
                             f"{ {rid: r.status.name for rid, r in self.sched.requests.items()} }")

    # -- checks ------------------------------------------------------------------------
    def in_fifo(self, rid: str) -> int:
        return sum(s.so.num_in_flight_tokens.get(rid, 0) for s in self.fifo)

    def check_in_flight(self) -> None:
        """Each live request's placeholders + stale tokens are exactly what the FIFO carries."""
        for rid, r in self.sched.requests.items():
            assert min(r.num_output_placeholders, r.num_stale_output_tokens,
                       r.num_in_flight_drafts) >= 0, rid
            assert r.num_in_flight_drafts <= r.num_output_placeholders, rid
            assert r.num_output_placeholders + r.num_stale_output_tokens == self.in_fifo(rid), (
                f"{rid}: {r.num_output_placeholders} placeholders + {r.num_stale_output_tokens} "
                f"stale, but {self.in_fifo(rid)} tokens in flight")
        assert self.sched.num_in_flight_tokens() == sum(
            self.in_fifo(rid) for rid in self.sched.requests)

    def check_ledger(self) -> None:
        assert not self.fifo and not self.sched.has_unfinished_requests()
        for rid, r in self.requests.items():
            got = self.delivered.get(rid, [])
            assert got == expected(r, len(got)), f"{rid}: delivered {got}"
            assert got == r.output_token_ids, rid
            if rid in self.at_abort:
                assert r.status == RequestStatus.FINISHED_ABORTED, rid
                assert got == self.at_abort[rid], f"{rid}: output after the abort"
                assert rid not in self.finish_reason, rid
            elif self.finish_reason.get(rid) == "error":   # a failed KV load, policy "fail"
                assert r.status == RequestStatus.FINISHED_ERROR, rid
            else:
                assert len(got) == r.max_tokens, f"{rid}: {len(got)} of {r.max_tokens} tokens"
                assert self.finish_reason.get(rid) == "length", rid
                assert (r.num_output_placeholders, r.num_stale_output_tokens,
                        r.num_in_flight_drafts) == (0, 0, 0), rid
        assert self.sched.num_in_flight_tokens() == 0
        self.sched.kv_cache.assert_no_leaks()


def add_requests(runner: AsyncRunner, n: int, prompt_len: int = 6, max_tokens: int = 8) -> list[Request]:
    # Different first tokens: no prefix sharing unless a test asks for it.
    reqs = [make_request(f"r{i}", prompt_len + i, first_token=100 * (i + 1), max_tokens=max_tokens)
            for i in range(n)]
    for r in reqs:
        runner.add(r)
    return reqs


# -- resets ------------------------------------------------------------------------------
def test_reset_when_drained_drops_nothing():
    sched = make_scheduler()
    runner = AsyncRunner(sched)
    reqs = add_requests(runner, 3)
    for _ in range(6):
        runner.pump(depth=2)
    while runner.fifo:
        runner.complete()
    before = {r.request_id: len(runner.delivered[r.request_id]) for r in reqs}
    assert all(before.values()) and sched.num_in_flight_tokens() == 0

    assert runner.reset() is True
    for r in reqs:
        assert r.status == RequestStatus.PREEMPTED and r.num_stale_output_tokens == 0
    # The first step after the reset (a recompute) is delivered, not dropped as stale.
    runner.schedule()
    runner.complete()
    assert {rid: len(runner.delivered[rid]) for rid in before} == {
        rid: n + 1 for rid, n in before.items()}
    runner.drain(depth=2)
    runner.check_ledger()


@pytest.mark.parametrize("warmup", [0, 3])   # 0: the in-flight token is the prefill's sample
def test_reset_with_one_token_in_flight_drops_exactly_one(warmup: int):
    sched = make_scheduler()
    runner = AsyncRunner(sched)
    reqs = add_requests(runner, 3)
    for _ in range(warmup):
        runner.schedule()
        runner.complete()
    so = runner.schedule()
    assert so.num_in_flight_tokens == {r.request_id: 1 for r in reqs}
    before = {r.request_id: list(runner.delivered[r.request_id]) for r in reqs}

    assert runner.reset() is True
    for r in reqs:
        assert (r.num_stale_output_tokens, r.num_output_placeholders) == (1, 0)
    assert sched.num_in_flight_tokens() == len(reqs)
    assert runner.complete() == []            # the stale step delivers nothing
    assert {rid: runner.delivered[rid] for rid in before} == before
    assert all(r.num_stale_output_tokens == 0 for r in reqs)
    runner.drain(depth=2)
    runner.check_ledger()


@pytest.mark.parametrize("drafts_right", [True, False])
def test_reset_with_drafts_in_flight_drops_one_plus_k(drafts_right: bool):
    k = 3
    # Stale count is 1 + k whether or not the drafts would have been accepted.
    propose = perfect_drafts(k) if drafts_right else (
        lambda rid, pos: [target(rid, pos), WRONG_DRAFT, target(rid, pos + 2)])
    sched = make_scheduler()
    runner = AsyncRunner(sched, propose)
    reqs = add_requests(runner, 2, max_tokens=12)
    runner.schedule()
    runner.complete()                          # prefill: first token, drafts proposed
    so = runner.schedule()
    for r in reqs:
        rid = r.request_id
        assert len(so.scheduled_spec_decode_tokens[rid]) == k
        assert so.num_scheduled_tokens[rid] == so.num_in_flight_tokens[rid] == 1 + k
        assert r.num_in_flight_drafts == k
    before = {r.request_id: list(runner.delivered[r.request_id]) for r in reqs}

    assert runner.reset() is True
    for r in reqs:
        assert (r.num_stale_output_tokens, r.num_output_placeholders, r.num_in_flight_drafts,
                r.spec_token_ids) == (1 + k, 0, 0, [])
    assert runner.complete() == []
    assert {rid: runner.delivered[rid] for rid in before} == before
    assert all(r.num_stale_output_tokens == 0 for r in reqs)
    runner.drain(depth=1)                      # depth 1: drafts keep being scheduled
    runner.check_ledger()


def test_two_resets_accumulate_stale_tokens():
    sched = make_scheduler()
    runner = AsyncRunner(sched)
    reqs = add_requests(runner, 2)
    runner.schedule()
    runner.schedule()                          # prefill and first decode: 2 tokens in flight
    assert all(r.num_output_placeholders == 2 for r in reqs)

    assert runner.reset() is True
    assert all(r.num_stale_output_tokens == 2 for r in reqs)
    assert runner.reset() is True              # nothing running now: the count stays
    assert all(r.num_stale_output_tokens == 2 for r in reqs)
    runner.schedule()                          # resumed by recompute: a third token in flight
    assert all((r.num_output_placeholders, r.num_stale_output_tokens) == (1, 2) for r in reqs)
    assert runner.reset() is True
    assert all((r.num_output_placeholders, r.num_stale_output_tokens) == (0, 3) for r in reqs)
    assert sched.num_in_flight_tokens() == 6

    for _ in range(3):
        assert runner.complete() == []
    assert all(r.num_stale_output_tokens == 0 for r in reqs)
    assert not any(runner.delivered.values())
    runner.drain(depth=2)
    runner.check_ledger()


def test_reset_under_kv_pressure_after_natural_preemption():
    # 11 usable blocks of 4 = 44 tokens; three requests grow to 25 tokens each.
    sched = make_scheduler(num_blocks=12, budget=16)
    runner = AsyncRunner(sched)
    add_requests(runner, 3, prompt_len=14, max_tokens=12)
    for _ in range(200):
        runner.pump(depth=2)
        if any(r.num_stale_output_tokens for r in sched.requests.values()):
            break
    else:
        pytest.fail("no preemption with output in flight")
    assert sched.num_preemptions > 0 and runner.fifo
    assert runner.reset() is True
    runner.drain(depth=2)
    runner.check_ledger()


# -- aborts ------------------------------------------------------------------------------
@pytest.mark.parametrize("abort_at", range(12))
def test_abort_at_any_event_keeps_what_was_delivered(abort_at: int):
    sched = make_scheduler(budget=8)
    runner = AsyncRunner(sched)
    victim = make_request("v", 12, max_tokens=8)     # 12 > budget: a chunked prefill first
    runner.add(victim)
    runner.add(make_request("o", 5, first_token=300, max_tokens=8))
    for _ in range(abort_at):
        runner.pump(depth=2)
    runner.abort("v")
    assert victim.status.finish_reason == "abort"
    assert runner.delivered["v"] == victim.output_token_ids == expected(victim, victim.num_output_tokens)
    runner.drain(depth=2)                      # later in-flight outputs for "v" must be ignored
    runner.check_ledger()


# -- max_tokens --------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [5, 21])   # 21 > budget 8: chunked prefill
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_async_never_schedules_past_max_tokens(prompt_len: int, max_tokens: int):
    sched = make_scheduler(budget=8)
    runner = AsyncRunner(sched)
    r = make_request("r", prompt_len, max_tokens=max_tokens)
    runner.add(r)
    runner.drain(depth=2)
    assert r.num_preemptions == 0
    # One step per output token, the first on the last prompt chunk: nothing wasted.
    assert runner.scheduled_tokens["r"] == prompt_len + max_tokens - 1
    runner.check_ledger()


@pytest.mark.parametrize("depth", [1, 2])   # 2: drafts must wait until nothing is in flight
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_drafts_never_reach_past_max_tokens(max_tokens: int, depth: int):
    # Every draft is right, so a draft scheduled past max_tokens would show as extra tokens.
    sched = make_scheduler(budget=8)
    runner = AsyncRunner(sched, perfect_drafts(4))
    r = make_request("r", 5, max_tokens=max_tokens)
    runner.add(r)
    runner.drain(depth=depth)
    assert runner.scheduled_tokens["r"] == 5 + max_tokens - 1
    runner.check_ledger()


# -- random interleavings ----------------------------------------------------------------
# Examples per run: the "ci" profile (default) runs 500, "long" 10,000 (see tests/conftest.py).
# Hypothesis draws the engine's shape and a seed; the seed drives the requests and the events.
# (Event lists drawn by hypothesis itself stay short, and the schedules that matter, like a
# preemption victim that was already given tokens this step, need long runs under KV pressure.)
@settings(deadline=None)
@given(num_blocks=st.integers(8, 20), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([8, 16, 64]), policy=st.sampled_from(["fcfs", "priority"]),
       seed=st.integers(0, 2**32 - 1), num_events=st.integers(20, 150))
def test_ledger_under_random_interleavings(num_blocks: int, depth: int, budget: int, policy: str,
                                           seed: int, num_events: int):
    """Depth 1 is sync scheduling; the KV oracle checks every read and every published block."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, policy=policy)
    runner = AsyncRunner(sched, random_drafts(random.Random(seed + 1)))

    def add() -> None:
        max_tokens = rng.randint(1, 12)
        # Prompt and output must fit the cache together, or the request could never finish.
        prompt_len = min(rng.randint(1, 30), (num_blocks - 1) * BS - max_tokens)
        # Three first tokens: some prompts share prefixes, so resumes and new requests hit.
        n = len(runner.requests)
        runner.add(make_request(f"r{n}", prompt_len, first_token=rng.choice((100, 100, 500)),
                                max_tokens=max_tokens, priority=rng.randint(0, 5),
                                arrival=float(n)))

    for _ in range(rng.randint(1, 8)):
        add()
    run_random_events(runner, rng, num_events, depth, add, add_weight=25)


def run_random_events(runner: AsyncRunner, rng: random.Random, num_events: int, depth: int,
                      add: Callable[[], None], add_weight: int) -> None:
    """Random engine events (add, reset, abort, schedule, complete), then a drain and the
    ledger check. `add_weight` of every 100 events add a request; 5 reset, 5 abort; of the
    rest, schedule (while fewer than `depth` steps are out) and complete split evenly-ish."""
    sched = runner.sched
    for _ in range(num_events):
        kind = rng.randrange(100)
        if kind < add_weight:
            add()
        elif kind < add_weight + 5:
            assert runner.reset() is True
        elif kind < add_weight + 10:
            if sched.requests:
                runner.abort(rng.choice(sorted(sched.requests)))
        elif kind < 62:
            if len(runner.fifo) < depth:
                runner.schedule()
        elif runner.fifo:
            runner.complete()
    runner.drain(depth)
    runner.check_ledger()


# -- regressions: two scheduler bugs these tests found ----------------------------------------
def test_reused_request_id_does_not_receive_the_old_requests_in_flight_output():
    sched = make_scheduler()
    sched.add_request(make_request("x", 5, max_tokens=4))
    old_step = sched.schedule()                          # old "x" samples position 5
    sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    new = make_request("x", 8, first_token=300, max_tokens=4)
    sched.add_request(new)                               # accepted: the id is free again
    sched.schedule()                                     # new "x" samples position 8
    outs = sched.update_from_output(
        old_step, ModelRunnerOutput(req_ids=["x"], sampled_token_ids=[[target("x", 5)]]))
    # The aborted request's token must not land in the new one, nor consume its placeholder.
    assert outs == [] and new.output_token_ids == []
    assert new.num_output_placeholders == 1


def test_priority_preemption_of_an_idle_earlier_request_does_not_skip_the_next():
    sched = make_scheduler(num_blocks=4, policy="priority")    # 3 usable blocks of 4
    # A (low priority) has its only output token in flight, so it has nothing to schedule.
    sched.add_request(make_request("A", 4, first_token=100, priority=5, arrival=0.0, max_tokens=1))
    sched.schedule()
    sched.add_request(make_request("B", 4, first_token=300, arrival=1.0))
    sched.add_request(make_request("C", 3, first_token=500, arrival=2.0))
    sched.schedule()                                           # B and C prefill: no block left
    so = sched.schedule()
    # B's decode needs a new block, so A is preempted; C's decode fits its block and must run.
    assert so.num_scheduled_tokens == {"B": 1, "C": 1}


def test_take_back_withdraws_the_blocks_it_published():
    """A request given tokens this step and then taken back as a preemption victim must not
    leave the blocks it published for those tokens in the prefix cache: their KV is never
    written, and a later prefix hit would read garbage (here M's hit on L's third block)."""
    sched = make_scheduler(num_blocks=6, policy="priority")      # 5 usable blocks of 4
    drafts = {("L", 12): [target("L", 12), target("L", 13)]}
    runner = AsyncRunner(sched, lambda rid, pos: drafts.get((rid, pos), []))
    low = make_request("L", 10, first_token=100, priority=2, arrival=0.0, max_tokens=8)
    runner.add(low)
    runner.schedule(), runner.complete()              # L: positions 0-9, three blocks
    runner.add(make_request("H", 4, first_token=500, priority=0, arrival=1.0, max_tokens=2))
    runner.schedule(), runner.complete()              # L decodes 10; H takes the fourth block
    # L computes 11 (filling and publishing its third block) and two drafts (a fifth block);
    # then H's decode needs a block, and the victim is L, already given its tokens.
    so = runner.schedule()
    assert so.num_scheduled_tokens == {"H": 1} and low.status == RequestStatus.PREEMPTED
    runner.complete()                                 # H finishes and frees its blocks
    follow_up = Request("M", low.all_token_ids[:12] + [999], SamplingParams(max_tokens=1),
                        eos_token_id=EOS, arrival_time=2.0, block_size=BS)
    follow_up.max_tokens = 1
    runner.add(follow_up)
    runner.drain(depth=1)                             # the oracle checks every read
    runner.check_ledger()
