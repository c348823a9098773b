"""Turns engine-core outputs into `RequestOutput`s: detokenize, stop strings, logprobs, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from treadle.core.scheduler_output import EngineCoreOutput, TokenLogprobs
from treadle.engine.detokenizer import IncrementalDetokenizer
from treadle.metrics import RequestMetrics
from treadle.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams


class TokenText:
    """Decodes single tokens for logprob entries, memoised."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._memo.get(token_id)
        if text is None:
            text = self._memo[token_id] = self.tokenizer.decode([token_id])
        return text


def to_logprob_dict(entry: TokenLogprobs, token_text: TokenText) -> dict[int, Logprob]:
    out = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.rank, token_text(entry.token_ids[0]))}
    for rank, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
        out.setdefault(tid, Logprob(lp, rank, token_text(tid)))
    return out


@dataclass
class SampleState:
    """One sequence being generated: a request, or one of the n samples of a request."""

    engine_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0   # for delta outputs
    num_cached_tokens: int | None = None   # its prompt's prefix-cache hit, once reported

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    """A user request and its samples (one unless n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list | None = None
    # The prompt's prefix-cache hit: with n > 1, the least of the samples' (the one that
    # computed the prompt; the others find its blocks), as usage counts the prompt once.
    num_cached_tokens: int = 0
    # Timings for metrics, time.monotonic() seconds.
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    queue_time: float | None = None
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, metrics: RequestMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.token_text = TokenText(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.weight_version: Any = None
        self.sample_of: dict[str, tuple[RequestState, SampleState]] = {}  # engine id -> sample

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, engine_ids: list[str]) -> None:
        """`engine_ids` names the engine-core request behind each of the n samples: ids the
        input processor never repeats, so no two requests' samples share one."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        assert not any(e in self.sample_of for e in engine_ids), f"engine ids reused: {engine_ids}"
        state = RequestState(request_id, prompt, prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        for index, engine_id in enumerate(engine_ids):
            sample = SampleState(engine_id, index, params,
                                 IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                                 [] if params.logprobs is not None else None)
            state.samples.append(sample)
            self.sample_of[engine_id] = (state, sample)
        self.requests[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput], weight_version: Any = None
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the request outputs to deliver, and engine ids a stop string just finished.

        `weight_version` is the engine's weight version when these tokens were produced."""
        self.weight_version = weight_version
        now = time.monotonic()
        # Per request, the samples this batch touched: one output each, every sample's delta in it.
        changed: dict[str, tuple[RequestState, dict[int, SampleState]]] = {}
        stopped_by_string: list[str] = []
        for out in outputs:
            entry = self.sample_of.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, sample = entry
            if out.new_token_ids or out.finish_reason != "error":   # an error carries no hit
                sample.num_cached_tokens = out.num_cached_tokens
            state.num_cached_tokens = min((s.num_cached_tokens for s in state.samples
                                           if s.num_cached_tokens is not None), default=0)
            state.queue_time = out.queue_time
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            # EOS or a stop token ended it: that token's text is not part of the output.
            stop_terminated = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            num_before = len(sample.detokenizer.token_ids)
            stop_string = sample.detokenizer.update(out.new_token_ids, stop_terminated)
            # A stop string that completes inside a multi-token step drops the ids after it:
            # their logprobs and their count go too, as if they had never been sampled.
            num_kept = len(sample.detokenizer.token_ids) - num_before
            if num_kept:
                self._observe_tokens(state, num_kept, now)
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                # Each position once: a prompt computed again (a LongRoPE request past its
                # short context restarts with the long factors) scores it otherwise, and the
                # prompt's logprobs are of the prompt alone (a helper's hunt: off by up to 200).
                first, entries = out.new_prompt_logprobs
                for offset, lp in enumerate(entries):
                    if state.prompt_logprobs[first + offset] is None:
                        state.prompt_logprobs[first + offset] = to_logprob_dict(lp, self.token_text)
            if out.new_logprobs and sample.logprobs is not None:
                sample.logprobs += [to_logprob_dict(lp, self.token_text)
                                    for lp in out.new_logprobs[:num_kept]]
            if stop_string is not None:
                # It ends the sample even where the core saw EOS or max_tokens later in the step.
                sample.finish_reason, sample.stop_reason = "stop", stop_string
                if out.finish_reason is None:
                    stopped_by_string.append(out.request_id)
            elif out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            changed.setdefault(state.request_id, (state, {}))[1][sample.index] = sample
            if sample.finished:   # the request's other samples did not change here
                self._retire(sample)
                if state.finished:
                    del self.requests[state.request_id]
                    self._observe_finished(state, now)
        ready = [out for state, samples in changed.values()
                 if (out := self._make_output(state, list(samples.values()))) is not None]
        return ready, stopped_by_string

    def _observe_tokens(self, state: RequestState, num_tokens: int, now: float) -> None:
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(num_tokens)
            if state.first_token_at is None:
                self.metrics.ttft.observe(now - state.arrival)
            else:
                self.metrics.itl.observe(now - state.last_token_at)
        if state.first_token_at is None:
            state.first_token_at = now
        state.last_token_at = now
        state.num_generated += num_tokens

    def _observe_finished(self, state: RequestState, now: float) -> None:
        m = self.metrics
        if m is None:
            return
        for sample in state.samples:
            m.finished.labels(finished_reason=sample.finish_reason).inc()
        m.prompt_tokens.inc(len(state.prompt_token_ids))
        m.e2e.observe(now - state.arrival)
        if state.queue_time is not None:
            m.queue_time.observe(state.queue_time)
        per_sample = state.num_generated / max(len(state.samples), 1)
        if state.first_token_at is not None and per_sample > 1:
            m.tpot.observe((now - state.first_token_at) / (per_sample - 1))

    def abort_request(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Finish a request as aborted; returns its final output and its unfinished engine ids."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None, []
        engine_ids = []
        aborted = []
        for sample in state.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
                engine_ids.append(sample.engine_id)
                aborted.append(sample)
                self._retire(sample)
        self._observe_finished(state, time.monotonic())
        if state.params.output_kind == RequestOutputKind.DELTA:
            return self._build(state, aborted, delta=True), engine_ids
        return self._build(state, state.samples, delta=False), engine_ids

    def _retire(self, sample: SampleState) -> None:
        self.sample_of.pop(sample.engine_id, None)

    def _make_output(self, state: RequestState, changed: list[SampleState]) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            # Finished now only if one of the samples that changed just finished (a finished
            # request's outputs never reach here again): one test for most steps, not n.
            if not any(s.finished for s in changed) or not state.finished:
                return None
            return self._build(state, state.samples, delta=False)
        if kind == RequestOutputKind.DELTA:
            return self._build(state, changed, delta=True)
        return self._build(state, state.samples, delta=False)

    def _build(self, state: RequestState, samples: list[SampleState], delta: bool) -> RequestOutput:
        """An output holding `samples`: everything so far, or (delta) only what is new."""
        completions = []
        for sample in samples:
            text = sample.detokenizer.get_next_output_text(sample.finished, delta=delta)
            if delta:
                token_ids, logprobs = self._take_delta(sample)
            else:
                # Copies: an output is what was so when it was made, and the lists go on growing.
                token_ids = list(sample.detokenizer.token_ids)
                logprobs = list(sample.logprobs) if sample.logprobs is not None else None
            completions.append(CompletionOutput(
                index=sample.index, text=text, token_ids=token_ids, logprobs=logprobs,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=state.finished,
            # A copy, as the samples' lists are: later chunks fill the state's in.
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            num_cached_tokens=state.num_cached_tokens, weight_version=self.weight_version,
            kv_transfer_params=state.kv_transfer_params)

    @staticmethod
    def _take_delta(sample: SampleState) -> tuple[list[int], list | None]:
        sent = sample.num_sent_tokens
        token_ids = list(sample.detokenizer.token_ids[sent:])
        logprobs = sample.logprobs[sent:] if sample.logprobs is not None else None
        sample.num_sent_tokens = len(sample.detokenizer.token_ids)
        return token_ids, logprobs
