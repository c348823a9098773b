"""The async-scheduling token ledger: every output token arrives exactly once, in order.

The fake runner samples, for request `rid` at sequence position `p`, the token `target(rid, p)`.
Since that is a pure function of the position, a token dropped, duplicated or delivered at the
wrong position (stale output not dropped after a preemption or reset, an off-by-one in the
placeholder count, a rejected draft not taken back) makes a request's delivered tokens differ
from `expected(request)`. Steps return in FIFO order, as the engine guarantees. Ids may be
reused: each add of an id is a tenancy with a name of its own (`id`, then `id@1`, ...), and
targets are by name, so the output of an earlier request with the same id never passes for
the new one's.

The driver (AsyncRunner) is EngineCore's step loop: an empty schedule never reaches the
workers, and an empty one with nothing in flight while requests wait is the engine's error.
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
from treadle.core.scheduler import Scheduler
from treadle.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
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


def expected(request: Request, n: int, name: str | None = None) -> list[int]:
    """Its first n output tokens; `name`: its tenancy's, when its id was used before."""
    name = request.request_id if name is None else name
    return [target(name, request.num_prompt_tokens + i) for i in range(n)]


# (rid, position the drafts would start at) -> drafts to propose, possibly none.
Proposer = Callable[[str, int], list[int]]


def perfect_drafts(k: int) -> Proposer:
    return lambda rid, pos: [target(rid, pos + j) for j in range(k)]


MAX_RANDOM_DRAFTS = 4


def random_drafts(rng: random.Random) -> Proposer:
    """Half the time 1..MAX_RANDOM_DRAFTS drafts, each right with probability 0.7."""
    def propose(rid: str, pos: int) -> list[int]:
        if rng.random() < 0.5:
            return []
        return [target(rid, pos + j) if rng.random() < 0.7 else WRONG_DRAFT + j
                for j in range(rng.randint(1, MAX_RANDOM_DRAFTS))]
    return propose


POISON = object()   # KV computed on top of a block that failed to load
HASH_BYTES = 32      # a block hash: sha256 (treadle/request.py hash_block)


def prefix_keys(tokens: list[int], gen: int) -> list[int]:
    """The key of every position: the whole token prefix ending there, under weight
    generation `gen` (the weights whose KV the chain carries)."""
    key, keys = gen, []
    for tok in tokens:
        key = hash((key, tok))
        keys.append(key)
    return keys


class KVOracle:
    """What every KV slot holds, as a fake worker would write it: the publishing invariant's test.

    Steps run in the order they are scheduled, so each is "executed" when it is scheduled: it
    writes its new tokens' slots, then every scheduled request reads all of its context. A slot
    holds a key for the whole token prefix ending at it, so a read of a slot never written, or
    written for other tokens (a block published and then taken back, a rejected draft, a block
    reused after eviction), fails at once.

    Keys carry a weight generation (`gen`, bumped by every weight update). A worker slot's KV
    chain carries the generation current when its tenancy began (its first schedule, or the
    asynchronous load it started with), for as long as the workers hold it: a request kept
    across a weight update goes on computing on its old KV, and what it computes carries the
    old generation. So KV of other weights read by anyone else (a prefix hit, a load from the
    store) fails the read check, and so does a published block of another generation.

    `slots` is a dict, or a mapping over a real KV cache tensor (tests/test_kv_interleavings.py)
    that a real connector's worker side loads into and saves from; `worker` is then that
    connector's worker side, which lands the loads instead of the oracle.

    `windows`: each KV cache group's sliding window (None: full attention). A request has a
    table per group; every step writes each new token in every group's table, and a group
    with a window reads only the keys in its first query's window. The tables' leading entries
    the scheduler gave back are the null block (0), as in the workers: a block given back while
    a window still needs it reads the null block or another request's KV, and fails. The null
    block is never written.
    """

    def __init__(self, block_size: int, slots=None, worker=None,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.block_size = block_size
        self.windows = windows
        # The workers' block tables per request, one per group.
        self.tables: dict[str, list[list[int]]] = {}
        self.slots = {} if slots is None else slots     # (block, offset) -> prefix key
        self.worker = worker
        # Requests whose KV load failed, until the workers drop their slot: every step of
        # theirs until then reads the missing block and computes poison.
        self.poisoned: set[str] = set()
        self.gen = 0                                    # the weights now
        self.gen_of: dict[str, int] = {}                # the generation each worker slot carries
        self.load_gen: dict[str, int] = {}              # of each asynchronous load, at its start

    def run_step(self, so: SchedulerOutput, input_tokens: Callable[[str, int, list[int]], list[int]],
                 load_fails: Callable[[str, int], bool] | None = None,
                 returning: set[str] = frozenset()) -> set[int]:
        """`input_tokens(rid, end, drafts)`: the request's tokens at positions [0, end).
        `returning`: requests back from an asynchronous load when the step was scheduled.

        The step's KV loads (`so.kv_loads`) land first, except blocks `load_fails(rid, index)`
        picks (or the real connector fails): those keep whatever they held, and what their
        request computes on top of them is poison. Returns the ids of the blocks that failed to
        load (with a real connector: every load error its worker side reports for the step)."""
        invalid: set[int] = set()
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.poisoned.discard(rid)
            self.gen_of.pop(rid, None)
        start: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            self.tables[rid] = [list(ids) for ids in new.block_ids]
            start[rid] = new.num_computed_tokens
            load_gen = self.load_gen.pop(rid, None)
            self.gen_of[rid] = load_gen if load_gen is not None and rid in returning else self.gen
        for rid in so.async_kv_loads:
            self.load_gen[rid] = self.gen
        cached = so.scheduled_cached_reqs
        for rid, blocks, num_computed, num_null in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                cached.num_null_blocks, strict=True):
            for table, ids, n_null in zip(self.tables[rid], blocks, num_null, strict=True):
                table += ids
                table[:n_null] = [0] * n_null
            start[rid] = num_computed
        keys: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            keys[rid] = prefix_keys(input_tokens(rid, start[rid] + n,
                                                 so.scheduled_spec_decode_tokens.get(rid, [])),
                                    self.gen_of[rid])
        if self.worker is not None:
            invalid = self.worker.before_forward(so)
            for rid, (_, block_ids, _) in so.kv_loads.items():
                if invalid & set(block_ids):
                    self.poisoned.add(rid)
        else:
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
                for g in range(len(self.windows)):
                    slot = self._slot(rid, pos, g)
                    assert slot[0] != 0, f"{rid} writes position {pos} to the null block (group {g})"
                    self.slots[slot] = POISON if rid in self.poisoned else keys[rid][pos]
        for rid, prefix in keys.items():
            if rid in self.poisoned:
                continue   # it reads a block that never arrived: its steps are recovered from
            for g, window in enumerate(self.windows):
                first_read = 0 if window is None else max(0, start[rid] - window + 1)
                for pos, key in enumerate(prefix[first_read:], start=first_read):
                    slot = self._slot(rid, pos, g)
                    assert self.slots.get(slot) == key, (
                        f"{rid} reads position {pos} from block {slot[0]} (group {g}), which does "
                        "not hold its KV" + ("" if self.slots.get(slot) is not None
                                             else " (never written)"))
        return invalid

    def load(self, rid: str, first: int, block_ids: list[int],
             input_tokens: Callable[[str, int, list[int]], list[int]],
             load_fails: Callable[[str, int], bool] | None, gen: int | None = None) -> set[int]:
        """An asynchronous load lands (KV of generation `gen`, the weights when it started);
        returns the blocks that failed (left as they were)."""
        keys = prefix_keys(input_tokens(rid, (first + len(block_ids)) * self.block_size, []),
                           self.gen if gen is None else gen)
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
        """Every block in the prefix cache holds the KV of the tokens its hash stands for, under
        the weights now, except `exempt` ones: blocks whose load failed in a step that has not
        returned yet, which the scheduler withdraws when it does (nothing can reach them before)."""
        for block_hash, block in hash_to_block.items():
            if block.block_id in exempt:
                continue
            # A group's key past the first is the block's hash and one byte (group_hash).
            keys = prefix_keys(tokens_of[block_hash[:HASH_BYTES]], self.gen)
            for offset, key in enumerate(keys[-self.block_size:]):
                assert self.slots.get((block.block_id, offset)) == key, (
                    f"block {block.block_id} is published, but slot {offset} does not hold its KV")

    def _slot(self, rid: str, pos: int, group: int = 0) -> tuple[int, int]:
        return self.tables[rid][group][pos // self.block_size], pos % self.block_size


@dataclass
class InFlightStep:
    so: SchedulerOutput
    first_pos: dict[str, int]   # rid -> position of the first token this step samples for it
    names: dict[str, str]       # rid -> the tenancy of that id it was scheduled for
    invalid_block_ids: set[int] = field(default_factory=set)   # its KV loads that failed
    kv_output: KVConnectorOutput | None = None   # what a real connector's worker side reported


class EngineStalled(RuntimeError):
    """EngineCore.step's error: nothing in flight, requests unfinished, and an empty schedule."""


class AsyncRunner:
    """Drives the scheduler as EngineCore does: steps are scheduled ahead and returned in order;
    an empty schedule never reaches the workers, and one with nothing in flight while requests
    are unfinished is the engine's "no progress" error (unless the connector could not tell
    yet: then the engine schedules again); resets, pauses and weight updates drain
    first, as the engine does.

    Client ids may be reused: each add of an id is a tenancy, named by the id the first time
    and `id@k` after, and the fake model samples by tenancy (`target(name, pos)`), so output
    or KV of an earlier request with the same id that reaches the new one shows.
    """

    def __init__(self, sched: Scheduler, propose: Proposer | None = None,
                 load_fails: Callable[[str, int], bool] | None = None,
                 load_steps: int = 2, worker=None) -> None:
        self.sched = sched
        self.propose = propose
        self.load_fails = load_fails   # (rid, block index) -> whether that KV load fails
        # Asynchronous KV loads finish `load_steps` returned steps after they start.
        self.load_steps = load_steps
        # A real connector's worker side (tests/test_kv_interleavings.py): it moves the KV
        # between the oracle's slots and the store and reports loads, instead of the fakes here.
        self.worker = worker
        self.loading: dict[str, list] = {}   # rid -> [(first block, block ids, tenancy), steps left, name, gen]
        self.sending: dict[str, int] = {}    # rid -> steps left until its blocks are sent
        self.fifo: deque[InFlightStep] = deque()
        self.requests: dict[str, Request] = {}     # every tenancy ever added, by name
        self.current: dict[str, str] = {}          # id -> the name of its latest tenancy
        self._uses: dict[str, int] = defaultdict(int)
        self.delivered: dict[str, list[int]] = defaultdict(list)   # by name
        self.finish_reason: dict[str, str] = {}
        self.at_abort: dict[str, list[int]] = {}   # what had been delivered when it was aborted
        self.scheduled_tokens: dict[str, int] = defaultdict(int)
        self.kv = KVOracle(sched.block_size, worker.slots if worker is not None else None, worker,
                           sched.kv_cache.group_windows)
        self.tokens_of_hash: dict[bytes, list[int]] = {}   # every block hash seen -> its tokens
        self.paused = False
        self.weight_updates = 0
        self.last_aborted: str | None = None

    # -- engine actions ----------------------------------------------------------------
    def add(self, request: Request) -> str:
        """Adds a request (ValueError, as from the engine, if its id is still in use); returns
        its tenancy's name."""
        rid = request.request_id
        self.sched.add_request(request)
        n = self._uses[rid]
        self._uses[rid] += 1
        name = rid if n == 0 else f"{rid}@{n}"
        self.requests[name] = request
        self.current[rid] = name
        return name

    def schedule(self, poll: bool = False) -> SchedulerOutput:
        """A step; with `poll`, the step with no tokens the engine uses to wait for loads. An
        empty step is not sent (not queued); with nothing in flight and requests unfinished it
        is the engine's error."""
        returning = {r.request_id for r in self.sched.loaded}
        so = self.sched.poll_kv_loads() if poll else self.sched.schedule()
        if so.is_empty and not poll:
            # The engine waits and schedules again while the connector cannot tell yet what it
            # can load (SchedulerOutput.waiting_for_connector); otherwise it is stuck.
            if (not self.fifo and self.sched.has_unfinished_requests()
                    and not so.waiting_for_connector):
                raise EngineStalled("scheduler made no progress with requests waiting: " + str(
                    {rid: r.status.name for rid, r in self.sched.requests.items()}))
            return so
        names = {rid: self.current[rid] for rid in so.num_scheduled_tokens}
        for rid in so.scheduled_spec_decode_tokens:
            # Drafts follow the last known token, so nothing may be in flight ahead of them.
            assert self.in_fifo(names[rid]) == 0, f"{rid}: drafts scheduled with output in flight"
        # Read right after schedule(): num_computed_tokens already counts this step's tokens,
        # drafts included, and the first sample follows the last non-draft token.
        first_pos = {rid: self.sched.requests[rid].num_computed_tokens
                     - len(so.scheduled_spec_decode_tokens.get(rid, ()))
                     for rid in so.num_in_flight_tokens}
        for rid, n in so.num_scheduled_tokens.items():
            self.scheduled_tokens[names[rid]] += n
        invalid = self.kv.run_step(so, self.input_tokens, self.load_fails, returning)
        kv_output = self.worker.after_forward() if self.worker is not None else None
        self.fifo.append(InFlightStep(so, first_pos, names, invalid, kv_output))
        for rid, load in so.async_kv_loads.items():
            self.loading[rid] = [load, self.load_steps, self.current[rid], self.kv.gen]
        self.check_published()
        self.check_in_flight()
        return so

    def check_published(self) -> None:
        for r in self.sched.requests.values():
            for i in range(len(r.block_hashes)):
                self.tokens_of_hash.setdefault(r.block_hashes[i], r.all_token_ids[:(i + 1) * BS])
        # Requests with a failed load in a step not yet returned, and every block they hold.
        failing = {rid for step in self.fifo for rid, (_, ids, _) in step.so.kv_loads.items()
                   if step.invalid_block_ids & set(ids) and step.names.get(rid) == self.current.get(rid)}
        exempt = {b for rid in failing for b in self.sched.kv_cache.get_connector_block_ids(rid)}
        self.kv.check_published(self.sched.kv_cache.pool.hash_to_block, self.tokens_of_hash, exempt)

    def finish_async_loads(self) -> tuple[set[str], set[int]]:
        """Asynchronous loads due with this returned step: they write their blocks (but the
        failing ones); returns the requests done and the blocks that failed."""
        done, invalid = set(), set()
        for rid, entry in list(self.loading.items()):
            entry[1] -= 1
            if entry[1] > 0:
                continue
            (first, block_ids, _), _, name, gen = entry
            del self.loading[rid]
            done.add(rid)
            invalid |= self.kv.load(rid, first, block_ids,
                                    lambda _rid, end, drafts: self.tokens_of(name, end, drafts),
                                    self.load_fails, gen)
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
        """A step's input for the live request `rid`: see tokens_of."""
        return self.tokens_of(self.current[rid], end, drafts)

    def tokens_of(self, name: str, end: int, drafts: list[int]) -> list[int]:
        """A step's input: the prompt, the outputs (known or in flight), then its drafts."""
        prompt = self.requests[name].prompt_token_ids
        known = end - len(drafts)
        return (prompt[:known] + [target(name, p) for p in range(len(prompt), known)]
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
            name, p = step.names[rid], step.first_pos[rid]
            tokens: list[int] = []
            for j, draft in enumerate(so.scheduled_spec_decode_tokens.get(rid, ())):
                if draft != target(name, p + j):
                    break
                tokens.append(draft)
            tokens.append(target(name, p + len(tokens)))   # the bonus token
            sampled.append(tokens)
            if self.propose is not None and (drafts := self.propose(name, p + len(tokens))):
                proposals[rid] = drafts
        if self.worker is not None:
            self.worker.tick()   # time passes: asynchronous loads due now land
            kv_output = step.kv_output
        else:
            recved, invalid = self.finish_async_loads()
            kv_output = KVConnectorOutput(finished_sending=self.finish_sends(),
                                          finished_recving=recved,
                                          invalid_block_ids=step.invalid_block_ids | invalid)
        outs = self.sched.update_from_output(
            so, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                  draft_token_ids=proposals, kv_connector_output=kv_output))
        for out in outs:
            name = self.current[out.request_id]
            assert name not in self.finish_reason, f"{name}: output after finishing"
            self.delivered[name].extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reason[name] = out.finish_reason
        self.check_published()
        self.check_in_flight()
        return outs

    def finish_in_flight(self) -> None:
        """EngineCore.drain: every step in flight returns."""
        while self.fifo:
            self.complete()

    def wait_for_kv_transfers(self) -> None:
        """EngineCore._wait_for_kv_transfers: polls until no load or send is outstanding."""
        while self.sched.num_kv_transfers():
            self.schedule(poll=True)
            self.finish_in_flight()

    def reset(self) -> bool:
        """The scheduler's reset with steps still in flight (their output goes stale); before
        it, outstanding KV transfers are waited for, as EngineCore does."""
        if self.sched.num_kv_transfers():   # as EngineCore does: steps in flight, then transfers
            self.finish_in_flight()
            self.wait_for_kv_transfers()
        ok = self.sched.reset_prefix_cache(reset_running_requests=True)
        self.check_in_flight()
        return ok

    def engine_reset(self) -> bool:
        """EngineCore.reset_prefix_cache(reset_running_requests=True): drain, then transfers."""
        self.finish_in_flight()
        self.wait_for_kv_transfers()
        ok = self.sched.reset_prefix_cache(reset_running_requests=True)
        self.check_in_flight()
        return ok

    def pause(self, clear_cache: bool = True) -> None:
        """EngineCore.pause(mode="keep", clear_cache): no schedules until resume()."""
        self.paused = True
        self.finish_in_flight()
        if clear_cache:
            assert self.engine_reset(), "no block may be held once running requests are reset"

    def resume(self) -> None:
        self.paused = False

    def can_update_weights(self) -> bool:
        """EngineCore._check_quiet: paused, or nothing running."""
        return self.paused or not self.sched.running

    def update_weights(self) -> None:
        """EngineCore._change_weights: drain, wait for KV transfers, then the scheduler hears of
        the new weights (Scheduler.weights_changed)."""
        assert self.can_update_weights()
        self.finish_in_flight()
        self.wait_for_kv_transfers()
        self.weight_updates += 1
        self.kv.gen += 1
        self.sched.weights_changed(f"weights-{self.weight_updates}")
        self.check_published()

    def abort(self, rid: str) -> None:
        assert rid in self.sched.requests, f"{rid} is not live"
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        name = self.current[rid]
        self.at_abort[name] = list(self.delivered[name])
        self.last_aborted = rid
        self.check_in_flight()

    def step(self, depth: int) -> None:
        """EngineCore.step with a batch queue of `depth`: schedule if there is room (an empty
        schedule is not sent), then return the oldest step once the queue is full or nothing
        was scheduled."""
        scheduled = False
        if not self.paused and len(self.fifo) < depth and self.sched.has_unfinished_requests():
            before = len(self.fifo)
            self.schedule()
            scheduled = len(self.fifo) > before
        if not self.fifo or (scheduled and len(self.fifo) < depth):
            return
        self.complete()

    def pump(self, depth: int) -> None:
        """One event: schedule while fewer than `depth` steps are out (up to `depth` stay out,
        as in an engine with a deeper queue), else, or when the schedule is empty, complete."""
        if not self.paused and len(self.fifo) < depth and self.sched.has_unfinished_requests():
            before = len(self.fifo)
            self.schedule()
            if len(self.fifo) > before:
                return
        if self.fifo:
            self.complete()

    def drain(self, depth: int, max_events: int = 2000) -> None:
        for _ in range(max_events):
            if not self.sched.has_unfinished_requests() and not self.fifo:
                return
            self.step(depth)
        raise AssertionError(f"no progress after {max_events} events: "
                             f"{ {rid: r.status.name for rid, r in self.sched.requests.items()} }")

    # -- checks ------------------------------------------------------------------------
    def in_fifo(self, name: str) -> int:
        """Output tokens in flight for the tenancy `name` (a request id's first one: the id)."""
        rid = self.requests[name].request_id
        return sum(s.so.num_in_flight_tokens.get(rid, 0) for s in self.fifo
                   if s.names.get(rid) == name)

    def check_in_flight(self) -> None:
        """Each live request's placeholders + stale tokens are exactly what the FIFO carries."""
        for rid, r in self.sched.requests.items():
            in_fifo = self.in_fifo(self.current[rid])
            assert min(r.num_output_placeholders, r.num_stale_output_tokens,
                       r.num_in_flight_drafts) >= 0, rid
            assert r.num_in_flight_drafts <= r.num_output_placeholders, rid
            assert r.num_output_placeholders + r.num_stale_output_tokens == in_fifo, (
                f"{rid}: {r.num_output_placeholders} placeholders + {r.num_stale_output_tokens} "
                f"stale, but {in_fifo} tokens in flight")
        assert self.sched.num_in_flight_tokens() == sum(
            self.in_fifo(self.current[rid]) for rid in self.sched.requests)

    def check_ledger(self) -> None:
        assert not self.fifo and not self.sched.has_unfinished_requests()
        for name, r in self.requests.items():
            got = self.delivered.get(name, [])
            assert got == expected(r, len(got), name), f"{name}: delivered {got}"
            assert got == r.output_token_ids, name
            if name in self.at_abort:
                assert r.status == RequestStatus.FINISHED_ABORTED, name
                assert got == self.at_abort[name], f"{name}: output after the abort"
                assert name not in self.finish_reason, name
            elif self.finish_reason.get(name) == "error":   # a failed KV load, policy "fail"
                assert r.status == RequestStatus.FINISHED_ERROR, name
            else:
                assert len(got) == r.max_tokens, f"{name}: {len(got)} of {r.max_tokens} tokens"
                assert self.finish_reason.get(name) == "length", name
                assert (r.num_output_placeholders, r.num_stale_output_tokens,
                        r.num_in_flight_drafts) == (0, 0, 0), name
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
    run_random_requests(runner, rng, num_blocks, num_events, depth, max_prompt=30, max_tokens=12)


def run_random_requests(runner: AsyncRunner, rng: random.Random, num_blocks: int,
                        num_events: int, depth: int, max_prompt: int, max_tokens: int) -> None:
    """A few random requests, then `num_events` random events, new requests among them."""
    ids = RequestIds(runner, rng)

    def add() -> None:
        capacity = (num_blocks - 1) * BS
        output_len = rng.randint(1, min(max_tokens, capacity // 2))
        # Prompt and output must fit the cache together, or the request could never finish.
        prompt_len = min(rng.randint(1, max_prompt), capacity - output_len)
        # Three first tokens: some prompts share prefixes, so resumes and new requests hit.
        ids.add(make_request(ids.next(), prompt_len, first_token=rng.choice((100, 100, 500)),
                             max_tokens=output_len, priority=rng.randint(0, 5),
                             arrival=float(len(runner.requests))))

    for _ in range(rng.randint(1, 8)):
        add()
    run_random_events(runner, rng, num_events, depth, add, add_weight=25)


class RequestIds:
    """Request ids for random interleavings: fresh ones, or (`reuse` of the time) the id of an
    earlier request that is no longer live, maybe with a step or a KV load of its still in
    flight. The engine may refuse an id a connector still holds: a legal outcome."""

    def __init__(self, runner: AsyncRunner, rng: random.Random, reuse: float = 0.3) -> None:
        self.runner, self.rng, self.reuse = runner, rng, reuse
        self.count = 0
        self.refused = 0

    def next(self) -> str:
        done = [rid for rid in self.runner.current if rid not in self.runner.sched.requests]
        if done and self.rng.random() < self.reuse:
            last = self.runner.last_aborted
            if last in done and self.rng.random() < 0.5:
                return last   # the client sends it again at once, its steps still in flight
            return self.rng.choice(sorted(done))
        self.count += 1
        return f"r{self.count - 1}"

    def add(self, request: Request) -> bool:
        try:
            self.runner.add(request)
        except ValueError as e:
            assert "already in use" in str(e), e
            self.refused += 1
            return False
        return True


def run_random_events(runner: AsyncRunner, rng: random.Random, num_events: int, depth: int,
                      add: Callable[[], None], add_weight: int,
                      extra: Callable[[], None] | None = None) -> None:
    """Random engine events, then a drain and the ledger check. Of every 100 events,
    `add_weight` add a request; 4 reset the scheduler with steps still in flight, 5 abort (half
    of them followed at once by an add, which may reuse the aborted id),
    3 pause (mode "keep", with or without clear_cache; no steps until it resumes a few events
    later, adds and aborts go on), 2 update the weights (drained; paused, or nothing running),
    1 `extra` (if given); of the rest, schedule (while fewer than `depth` steps are out) and
    complete split evenly-ish. Depth 1 is sync: a step returns as soon as it is scheduled,
    so nothing happens between the two (EngineCore.step)."""
    sched = runner.sched
    resume_in = 0
    for _ in range(num_events):
        if runner.paused:
            resume_in -= 1
            if resume_in <= 0:
                runner.resume()
        kind = rng.randrange(100)
        if kind < add_weight:
            add()
        elif (kind := kind - add_weight) < 4:
            assert runner.reset() is True
        elif kind < 9:
            if sched.requests:
                # Half the time one with a step in flight (a KV load in it, if any has one).
                busy = sorted({rid for step in runner.fifo for rid in step.so.num_scheduled_tokens
                               if step.names[rid] == runner.current[rid]} & set(sched.requests))
                loading = sorted({rid for step in runner.fifo for rid in step.so.kv_loads
                                  if step.names[rid] == runner.current[rid]} & set(sched.requests))
                runner.abort(rng.choice(loading or busy) if busy and rng.random() < 0.5
                             else rng.choice(sorted(sched.requests)))
                if rng.random() < 0.5:
                    add()   # maybe the same id again, at once
        elif kind < 12:
            if not runner.paused:
                runner.pause(clear_cache=rng.random() < 0.5)
                resume_in = rng.randint(1, 8)
        elif kind < 14:
            if runner.can_update_weights():
                runner.update_weights()
        elif kind < 15:
            if extra is not None:
                extra()
        elif kind < 62 - add_weight:
            if not runner.paused and len(runner.fifo) < depth:
                if depth == 1:
                    runner.step(1)
                else:
                    runner.schedule()
        elif runner.fifo:
            runner.complete()
    runner.resume()
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
