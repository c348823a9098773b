"""A step whose sampled tokens stay on the device until the next step is on its way.

Under async scheduling the scheduler gives step N+1 one token after each of step N's samples
before N's tokens are known (their placeholders). A runner that waits for N's tokens before it
builds N+1 leaves the GPU idle for the whole of that host work. So, where a step's requests
need nothing of their last token on the host (no grammar, no penalties, no prompt logprobs, no
drafts: `plain`), the runner queues its sampling and returns at once with the step deferred:
its slots' token counts advance over a `PLACEHOLDER`, and the next step's input rows at those
positions take the tokens from the device (`device_tokens_for`), so step N+1 is queued behind N
with no wait between them. Then, while N+1 runs, N's tokens come to the host (`finish`, the
step's one sync) and replace the placeholders, except in slots whose request left meanwhile
(`drop`): a new tenant's tokens are its own. The executor hands the engine N's output when
finished (executor/uniproc.py's StepFuture); everything runs on the worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from treadle.device_copy import to_device
from treadle.sampling_params import SamplingParams
from treadle.worker.request_state import RequestSlots
from treadle.worker.sampler import Sampler, SamplerOutput, has_penalties, sampling_rows

# A deferred token's stand-in in the slots: never a token id, so an input row that reads it
# unpatched fails at the embedding instead of computing on a wrong token.
PLACEHOLDER = -1


def plain(params: SamplingParams) -> bool:
    """Whether a request's steps can be deferred: nothing in them reads its last token's value
    on the host before the next step (a grammar's next mask, a penalty's counts, the prompt
    logprobs' targets are host work on known tokens)."""
    return (params.structured_outputs is None and params.prompt_logprobs is None
            and not has_penalties(params))


def plain_step(so: SchedulerOutput, slots: RequestSlots) -> bool:
    """Whether every request of the step is plain and none verifies drafts."""
    if so.scheduled_spec_decode_tokens:
        return False
    params = [new.sampling_params for new in so.scheduled_new_reqs]
    params += [slots.params[slots.slot_of[rid]] for rid in so.scheduled_cached_reqs.req_ids]
    return all(plain(p) for p in params)


@dataclass
class DeferredStep:
    req_ids: list[str]           # the step's requests, in its row order
    sampled_rows: np.ndarray     # which of them sampled (indices into req_ids)
    slots: np.ndarray            # each sampling request's slot
    positions: np.ndarray        # where its token goes in the slot (its PLACEHOLDER now)
    samples: SamplerOutput       # on the device, one row per sampling request
    dropped: set[int] = field(default_factory=set)   # slots whose request has left since
    output: ModelRunnerOutput | None = None          # once finished

    @classmethod
    def queue(cls, sampler: Sampler, slots: RequestSlots, logits: torch.Tensor, req_ids: list[str],
              idx: np.ndarray, rows: np.ndarray, ends: np.ndarray) -> DeferredStep:
        """Queue the sampling of the step's `rows` (indices into req_ids; `idx`: every request's
        slot; `logits`: one row per sampling request) and leave the tokens on the device: each
        sampling slot advances over a PLACEHOLDER, and every slot's computed count becomes its
        `ends` entry."""
        slot_ids = idx[rows]
        samples = sampler.sample(logits, sampling_rows(slots, slot_ids))
        positions = slots.num_tokens[slot_ids].copy()
        for slot in slot_ids:
            slots.append_token(slot, PLACEHOLDER)
        slots.num_computed_tokens[idx] = ends
        return cls(req_ids, rows, slot_ids, positions, samples)

    def drop(self, slot: int) -> None:
        """The slot's request leaves (finished, aborted or preempted) before this step finished:
        its token is reported but never written into the slot."""
        self.dropped.add(slot)

    def device_tokens_for(self, token_slot: np.ndarray, positions: np.ndarray,
                          max_slots: int) -> tuple[np.ndarray, torch.Tensor] | None:
        """The rows of a step's flat input (each row's slot and position) that read one of this
        step's tokens, and those tokens, still on the device; None where no row does."""
        pending_pos = np.full(max_slots, -1, dtype=np.int64)
        pending_row = np.zeros(max_slots, dtype=np.int64)
        for k, (slot, pos) in enumerate(zip(self.slots.tolist(), self.positions.tolist())):
            if slot not in self.dropped:
                pending_pos[slot], pending_row[slot] = pos, k
        rows = np.flatnonzero(pending_pos[token_slot] == positions)
        if not len(rows):
            return None
        tokens = self.samples.token_ids
        return rows, tokens[to_device(pending_row[token_slot[rows]], tokens.device)]

    def finish(self, slots: RequestSlots) -> ModelRunnerOutput:
        """Bring the tokens (and logprobs) to the host, put them in the slots still held by
        their requests, and make the step's output."""
        if self.output is not None:
            return self.output
        tokens, token_lps = self.samples.to_lists()
        for slot, pos, token in zip(self.slots.tolist(), self.positions.tolist(), tokens):
            if slot not in self.dropped:
                assert slots.token_ids[slot, pos] == PLACEHOLDER, f"slot {slot} moved under a deferred token"
                slots.token_ids[slot, pos] = token
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for r, token, lp in zip(self.sampled_rows.tolist(), tokens, token_lps):
            sampled[r] = [token]
            if lp is not None:
                logprobs[self.req_ids[r]] = [lp]
        self.output = ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled,
                                        logprobs=logprobs)
        return self.output
