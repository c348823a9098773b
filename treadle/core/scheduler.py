"""Continuous-batching scheduler: decides, each step, which tokens of which requests to compute.

There are no separate prefill and decode phases. Each request has `num_tokens` known tokens and
`num_computed_tokens` of them computed; a step gives each scheduled request a number of new tokens
to compute, within `max_num_batched_tokens` and `max_num_seqs`. That one rule covers chunked
prefill, decode, prefix-cache hits and resumption after preemption.

With async scheduling the next step is scheduled before the previous one returns. Output still
in flight is counted in tokens on each request (`num_output_placeholders`), so a request whose
next token is not back yet still gets its decode scheduled, no step is scheduled whose output
could only go past `max_tokens`, and a preemption or reset drops exactly the stale tokens that
were in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.admission import ASK_AGAIN, admit
from treadle.core.kv_load_recovery import settle_async_load, settle_kv_loads
from treadle.core.waiting_queue import WaitingQueue
from treadle.core.stats import SchedulerStats, SpecDecodingStats
from treadle.core.scheduler_output import (
    CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput)
from treadle.kv_transfer.base import KVConnectorBase
from treadle.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, max_model_len: int, seed: int = 0,
                 connector: KVConnectorBase | None = None,
                 kv_load_failure_policy: str = "recompute",
                 long_rope_after: int | None = None, window_reach: int | None = None) -> None:
        """`window_reach` (config.window_reach) bounds what a windowed KV cache group holds of a
        request; without it, every group is counted as holding the whole request."""
        self.config = sched_config
        # LongRoPE (models/rope.py): a request longer than this takes the long factors for all
        # its tokens. One that grows past it is restarted and recomputed with them (as
        # transformers does); until then no position from here on is computed for it.
        self.long_rope_after = long_rope_after
        self.connector = connector   # its scheduler side, when KV crosses the engine's boundary
        self.kv_load_failure_policy = kv_load_failure_policy
        # Asynchronous KV loads going on, per request (as in SchedulerOutput.kv_loads), and
        # requests that ended meanwhile, whose blocks are freed only once the load is done
        # (then handed to `sending` instead, if the connector asked to free them late).
        self.loading: dict[str, tuple[int, list[int], int]] = {}
        self.free_after_load: dict[str, tuple[Request, bool]] = {}
        # Finished requests whose blocks the connector still reads (delay_free_blocks): freed
        # when it reports them sent (finished_sending).
        self.sending: dict[str, Request] = {}
        # Requests back from an asynchronous load: they hold the blocks of their whole prompt,
        # so they can always start, and they start before the waiting queue.
        self.loaded: list[Request] = []
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        # Blocks behind a group's sliding window are given back while a request runs, unless
        # a connector may still save or send the request's whole KV.
        windows = cache_config.kv_groups.group_windows
        assert connector is None or len(windows) == 1, "KV connectors run with one KV cache group"
        self.kv_cache = KVCacheManager(num_blocks, cache_config.block_size,
                                       cache_config.enable_prefix_caching,
                                       windows if connector is None else (None,),
                                       window_reach)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(sched_config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()   # to tell the workers next step
        # Finished requests' steps still in flight, by id: their output is dropped on arrival.
        self._finished_in_flight: dict[str, int] = {}
        self._seed_rng = random.Random(seed)
        self._tenancies = itertools.count()   # Request.tenancy: never repeated
        self._generator_seeds: dict[str, int] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()

    # -- requests in and out ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.check_request(request)
        seed = request.sampling_params.seed
        self._generator_seeds[request.request_id] = (
            seed if seed is not None else self._seed_rng.getrandbits(62))
        self.requests[request.request_id] = request
        request.tenancy = next(self._tenancies)
        self._choose_rope(request)
        self.waiting.add(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError if `request` could never be added (its id in use, too long)."""
        if any(request.request_id in held for held in (self.requests, self.free_after_load,
                                                        self.sending)):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {request.num_tokens} tokens; it must be shorter than "
                f"max_model_len ({self.max_model_len}) to leave room for output")
        if not self.kv_cache.can_fit(request.num_tokens + 1):
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs "
                f"{self.kv_cache.peak_blocks(request.num_tokens + 1)} KV blocks at once, more than "
                f"the cache has ({self.kv_cache.pool.num_usable_blocks} blocks of {self.block_size})")

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> None:
        """End requests from outside the step loop (abort, stop string found by the detokenizer)."""
        assert status.is_finished
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif loading:
                del self.loading[rid]
            elif request in self.loaded:
                self.loaded.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request, keep_blocks=loading)

    def _free(self, request: Request, keep_blocks: bool = False) -> None:
        """Forget a finished request. Its blocks are freed now, unless a load still writes into
        them (keep_blocks: freed when the load is done) or the connector still sends them
        (delay_free_blocks: freed when it reports them sent)."""
        delay = False
        if self.connector is not None:
            delay, request.kv_transfer_params = self.connector.request_finished(
                request, self.kv_cache.get_connector_block_ids(request.request_id))
        if keep_blocks:
            self.free_after_load[request.request_id] = (request, delay)
        elif delay:
            self.sending[request.request_id] = request
        else:
            self.kv_cache.free(request)
        if request.num_in_flight_steps:
            # Its steps still in flight return before any step of a new request with its id.
            self._finished_in_flight[request.request_id] = (
                self._finished_in_flight.get(request.request_id, 0) + request.num_in_flight_steps)
        self._finished_ids.add(request.request_id)
        self._generator_seeds.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _drop_output_of_finished(self, rid: str) -> bool:
        left = self._finished_in_flight.get(rid)
        if left is None:
            return False
        if left == 1:
            del self._finished_in_flight[rid]
        else:
            self._finished_in_flight[rid] = left - 1
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or finished with KV still moving in or out of their blocks."""
        return bool(self.requests) or self.num_kv_transfers() > 0

    def num_kv_transfers(self) -> int:
        """Requests whose blocks a connector still writes (asynchronous loads, ended requests'
        included) or reads (delayed frees)."""
        return len(self.loading) + len(self.free_after_load) + len(self.sending)

    # -- the step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        new_blocks_of: dict[str, list[list[int]]] = {}   # per KV cache group
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}
        # Blocks each scheduled running request had published before this step's allocation.
        published_before: dict[str, int] = {}
        kv_loads: dict[str, tuple[int, list[int], int]] = {}   # see SchedulerOutput.kv_loads
        async_loads: dict[str, tuple[int, list[int], int]] = {}

        # 1. Running requests first, in order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._grew_past_short_rope(request):
                self._restart(request)   # running[i] is now the next one
                continue
            num_new, drafts = self._num_new_tokens(request, budget)
            if num_new <= 0:
                i += 1
                continue
            published_before[request.request_id] = self.kv_cache.num_published_blocks(request)
            while True:
                blocks = self.kv_cache.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1   # its removal shifts the requests after it
                if victim in scheduled_running:
                    # It was given tokens earlier this step: take them back, and withdraw
                    # the blocks it published for them, whose KV will never be written.
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks_of.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                    self.kv_cache.unpublish(victim, published_before[victim.request_id])
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                continue  # `request` itself was preempted; running[i] is now the next one
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            new_blocks_of[request.request_id] = [[b.block_id for b in group] for group in blocks]
            if drafts:
                spec_tokens[request.request_id] = drafts
            budget -= num_new
            i += 1

        # 2. Requests back from an asynchronous load (they hold every block they need, so they
        # start even in a step that had to preempt: requests holding blocks never wait behind
        # requests that need them), then waiting ones, unless this step had to preempt.
        waiting_for_connector = False
        while ((self.loaded or (not preempted and len(self.waiting))) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.loaded[0] if self.loaded else self.waiting.peek()
            num_new = admit(self, request, budget, num_scheduled, kv_loads, async_loads)
            if num_new is None or num_new == ASK_AGAIN:
                waiting_for_connector = num_new == ASK_AGAIN
                break   # it cannot start now; the queue keeps its order
            budget -= num_new
            if num_new:
                scheduled_new.append(self.running[-1])

        new_reqs = [
            NewRequestData(
                req_id=r.request_id, token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens, sampling_params=r.sampling_params,
                block_ids=self.kv_cache.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                generator_seed=self._generator_seeds[r.request_id], eos_token_id=r.eos_token_id,
                long_rope=r.long_rope, grammar_waits_for=r.grammar_waits_for)
            for r in scheduled_new
        ]
        cached = CachedRequestData()
        for r in scheduled_running:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(new_blocks_of[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_null_blocks.append(self.kv_cache.num_null_blocks(r.request_id))

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens, kv_loads=kv_loads,
            async_kv_loads=async_loads, num_kv_transfers=self.num_kv_transfers(),
            waiting_for_connector=waiting_for_connector)
        # An empty step never reaches the workers: keep the ids for the next one that does.
        if not out.is_empty:
            out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        # Computed counts advance at schedule time: the next schedule() already sees this step's
        # work. A chunk that reaches past every known and in-flight token samples, putting
        # 1 + drafts output tokens in flight.
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            num_drafts = len(spec_tokens.get(rid, ()))
            req.num_computed_tokens += n
            req.num_in_flight_steps += 1
            if req.num_computed_tokens - num_drafts >= req.num_tokens + req.num_output_placeholders:
                out.num_in_flight_tokens[rid] = 1 + num_drafts
                req.num_output_placeholders += 1 + num_drafts
                req.num_in_flight_drafts += num_drafts
                req.spec_token_ids = []
            assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        if self.connector is not None and not out.is_empty:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def poll_kv_loads(self) -> SchedulerOutput:
        """A step with no tokens that lets the workers report asynchronous loads finished
        (while paused, or before the prefix cache is reset)."""
        out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                              num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                              finished_req_ids=self._finished_ids,
                              num_kv_transfers=self.num_kv_transfers())
        self._finished_ids = set()
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _num_new_tokens(self, request: Request, budget: int) -> tuple[int, list[int]]:
        """Tokens to compute for a running request this step, and the drafts among them."""
        if request.num_in_flight_drafts:
            return 0, []   # its next position depends on how many drafts survive
        in_flight = request.num_output_placeholders
        if request.spec_token_ids and in_flight:
            # Async: drafts must follow the token still in flight; sit this step out so the
            # next one can verify fresh drafts (1 + k tokens) instead of decoding one.
            return 0, []
        if (request.num_output_tokens + in_flight >= request.max_tokens
                or request.num_tokens + in_flight >= self.max_model_len):
            return 0, []   # what is in flight already reaches the limit
        num_new = min(request.num_tokens + in_flight - request.num_computed_tokens, budget)
        short_rope_room = self.max_model_len
        if self.long_rope_after is not None and not request.long_rope:
            # Positions from long_rope_after on are computed only with the long factors.
            short_rope_room = self.long_rope_after - request.num_computed_tokens
            num_new = min(num_new, short_rope_room)
            if num_new <= 0:
                return 0, []
        drafts: list[int] = []
        if request.spec_token_ids and num_new == 1:
            # Room for 1 + k outputs: never propose past max_tokens or max_model_len.
            room = min(request.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens, budget, short_rope_room) - 1
            drafts = request.spec_token_ids[:max(room, 0)]
        return num_new + len(drafts), drafts

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            # Larger value = lower priority; among equals, the latest arrival goes first.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def preempt(self, request: Request) -> None:
        """Free the request's blocks and put it back at the front of the queue; what it has in
        flight becomes stale, and it resumes by recompute (from its prefix-cache hits)."""
        self._restart(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        logger.debug("preempted %s", request.request_id)

    def _restart(self, request: Request) -> None:
        """Take a running request back to the front of the queue with nothing computed."""
        self.running.remove(request)
        self.kv_cache.free(request)
        self._finished_ids.add(request.request_id)   # the workers drop its slot
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Whatever is still in flight was computed on the freed blocks: drop it when it arrives.
        request.num_stale_output_tokens += request.num_output_placeholders
        request.num_output_placeholders = 0
        request.num_in_flight_drafts = 0
        request.spec_token_ids = []
        request.tenancy = next(self._tenancies)
        self._choose_rope(request)
        self.waiting.add(request, front=True)

    def _past_short_rope(self, request: Request) -> bool:
        """Whether a request on the short factors is longer than the original context (see
        `long_rope_after`)."""
        return (self.long_rope_after is not None and not request.long_rope
                and request.num_tokens > self.long_rope_after)

    def _choose_rope(self, request: Request) -> None:
        """A request with nothing computed takes LongRoPE's long factors once it is longer
        than the original context."""
        if self._past_short_rope(request):
            request.use_long_rope()

    def _grew_past_short_rope(self, request: Request) -> bool:
        """Whether a running request computed with the short factors now holds a token past
        the original context, with nothing of it in flight: all it computed is recomputed
        with the long ones. (Its last short step is waited for: the token it samples is the
        short factors' answer, as in transformers.)"""
        return self._past_short_rope(request) and not request.num_in_flight_steps

    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Account for a returned step: steps return in the order they were scheduled."""
        outputs: list[EngineCoreOutput] = []
        kv_out = runner_out.kv_connector_output
        if self.connector is not None and kv_out is not None:
            self.connector.update_connector_output(kv_out)
        invalid = kv_out.invalid_block_ids if kv_out is not None else set()
        if sched_out.kv_loads:   # before the outputs: a failed load makes this step's stale
            outputs += settle_kv_loads(self, sched_out.kv_loads, invalid)
        # In id order: which of them starts first must not hang on a set's order.
        for rid in sorted(kv_out.finished_recving) if kv_out is not None else ():
            outputs += settle_async_load(self, rid, invalid)
        for rid in kv_out.finished_sending if kv_out is not None else ():
            if (request := self.sending.pop(rid, None)) is not None:
                self.kv_cache.free(request)
        finished: list[tuple[Request, EngineCoreOutput]] = []
        try:
            self._take_step_outputs(sched_out, runner_out, outputs, finished)
        finally:   # even where the runner's output was refused part way through
            if finished:
                # At once: removing each from the running list on its own is quadratic when
                # many finish in one step.
                gone = {id(request) for request, _ in finished}
                self.running[:] = [r for r in self.running if id(r) not in gone]
                for request, out in finished:
                    self._free(request)
                    out.kv_transfer_params = request.kv_transfer_params   # the connector's, once freed
        return outputs

    def _take_step_outputs(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput],
                           finished: list[tuple[Request, EngineCoreOutput]]) -> None:
        """update_from_output's loop over the step's requests: appends their outputs, and the
        requests that finished (with their outputs) for the caller to free."""
        sampled_of = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        # Looked up once: this loop runs for every request in the step (256 and more).
        in_flight_of, spec_of = sched_out.num_in_flight_tokens, sched_out.scheduled_spec_decode_tokens
        prompt_lps_of, errors_of = runner_out.prompt_logprobs, runner_out.request_errors
        logprobs_of, drafts_of = runner_out.logprobs, runner_out.draft_token_ids
        requests, running = self.requests, RequestStatus.RUNNING
        for rid in sched_out.num_scheduled_tokens:
            sampled = sampled_of.get(rid)
            num_in_flight = in_flight_of.get(rid, 0)
            if sampled is None or (num_in_flight and not sampled) or len(sampled) > num_in_flight:
                # Accepting it would leave the request's computed count past its known tokens,
                # and the request would never be scheduled again: fail loudly instead.
                raise RuntimeError(
                    f"request {rid} was scheduled to sample {num_in_flight} token(s), but the "
                    f"model runner returned {'no entry' if sampled is None else len(sampled)}")
            if self._finished_in_flight and self._drop_output_of_finished(rid):
                continue  # finished or aborted while the step ran (the id may be reused since)
            request = requests[rid]
            request.num_in_flight_steps -= 1
            if request.num_stale_output_tokens and num_in_flight:
                # Scheduled before a preemption or reset: FIFO order makes it the stale output.
                assert request.num_stale_output_tokens >= num_in_flight
                request.num_stale_output_tokens -= num_in_flight
                continue
            if request.status != running:
                continue  # a non-final chunk of a request preempted meanwhile
            request.num_output_placeholders -= num_in_flight
            num_drafts = len(spec_of[rid]) if rid in spec_of else 0
            request.num_in_flight_drafts -= num_drafts
            if sampled:
                # Rejected drafts were computed but are not part of the sequence.
                request.num_computed_tokens -= num_in_flight - len(sampled)
                if num_drafts:
                    # The drafts kept are the leading tokens equal to them (the runner's rule):
                    # not always all tokens but one, as a row with no token left ends the kept
                    # drafts with no sample after them (ModelRunner._verify). Where the first row
                    # had none, the one token is a placeholder and nothing was kept.
                    drafts, accepted = spec_of[rid], 0
                    if not (errors_of and rid in errors_of and len(sampled) == 1):
                        while (accepted < min(len(sampled), num_drafts)
                               and sampled[accepted] == drafts[accepted]):
                            accepted += 1
                    self.spec_stats.observe(num_drafts, accepted)
            prompt_lps = prompt_lps_of.get(rid) if prompt_lps_of else None
            if errors_of and rid in errors_of:   # it ends here, without this step's tokens
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = errors_of[rid]
                sampled = []
            elif not sampled and prompt_lps is None:
                continue  # a prefill chunk that is not the last one produces nothing
            new_ids: list[int] = []
            for tok in sampled:
                request.append_output_token_ids([tok])
                new_ids.append(tok)
                if self._check_stop(request):
                    break
            lps = logprobs_of.get(rid) if logprobs_of else None
            out = EngineCoreOutput(
                request_id=rid, new_token_ids=new_ids,
                new_logprobs=lps[:len(new_ids)] if lps is not None else None,
                new_prompt_logprobs=prompt_lps,
                num_cached_tokens=max(request.num_cached_tokens, 0), queue_time=request.queue_time)
            if request.status.is_finished:
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
                finished.append((request, out))
            elif rid in drafts_of:
                request.spec_token_ids = list(drafts_of[rid])
            outputs.append(out)

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # -- cache control -------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; False while any block is held.

        With reset_running_requests, every running request is preempted first (its in-flight
        output becomes stale) and resumes later by recompute.
        """
        if reset_running_requests:
            # From the back, each to the front of the queue: the waiting order stays FCFS.
            for request in reversed(list(self.running)):
                self.preempt(request)
            self._unload_loaded()
        return self.kv_cache.reset_prefix_cache()

    def _unload_loaded(self) -> None:
        """Requests back from a load and not started drop its KV and wait to start again."""
        for request in reversed(self.loaded):
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
            request.tenancy = next(self._tenancies)
            self.waiting.add(request, front=True)
        self.loaded.clear()

    def weights_changed(self, weights_identity: str) -> None:
        """After a weight change, with no step or KV transfer in flight: no prefix computed with
        the old weights is hit again, and the connector keys KV by the new identity. Requests
        back from a load drop the KV they loaded and start anew. Running ones (kept by a pause
        that kept the cache) go on from their KV, by the caller's choice, but never publish or
        save more: their later blocks sit on KV of the old weights."""
        assert not self.loading, "weights changed while KV loads into the cache"
        self._unload_loaded()
        self.kv_cache.reset_prefix_cache(force=True)
        if self.connector is not None:
            self.connector.weights_changed(weights_identity)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.loaded) + len(self.loading),
            kv_cache_usage=kv.pool.usage(), prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits, num_preemptions=self.num_preemptions,
            num_window_freed_blocks=kv.num_window_freed_blocks,
            spec_decoding=dataclasses.replace(self.spec_stats,
                                              accepted_per_position=list(self.spec_stats.accepted_per_position)),
            kv_tiers=self.connector.get_stats() if self.connector is not None else [])

    def num_in_flight_tokens(self) -> int:
        """Output tokens scheduled and not yet returned, stale ones included."""
        return sum(r.num_output_placeholders + r.num_stale_output_tokens
                   for r in self.requests.values())
