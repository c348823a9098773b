"""A step whose sampled tokens stay on the device until the next step is on its way.

Under async scheduling the scheduler gives step N+1 one token after each of step N's samples
before N's tokens are known (their placeholders). A runner that waits for N's tokens before it
builds N+1 leaves the GPU idle for the whole of that host work. So the runner queues N's
sampling and returns at once with the step deferred: its slots' token counts advance over a
`PLACEHOLDER`, and what of step N+1 reads those tokens takes them from the device
(`device_tokens_for`): its input rows at those positions, and the penalties' token counts. So
step N+1 is queued behind N with no wait between them. N's tokens, logprobs and prompt logprobs
start for the host as soon as they are sampled, ahead of N+1 (`HostCopy`). While N+1 runs,
`finish` waits for them (the step's one sync), and they replace the placeholders, except in
slots whose request left meanwhile (`drop`): a new tenant's tokens are its own. Grammar matchers advance there too; a step with a constrained request needs its mask,
so it finishes N after its own forward pass is queued and before it samples (not for a grammar
still waiting for the end of the reasoning: worker/grammar.py masks its row on the device).
The executor hands the engine N's output when finished (executor/uniproc.py's StepFuture);
everything runs on the engine's thread, the device computing beside it. Steps that verify
drafts are never deferred: the proposer reads host tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.core.scheduler_output import ModelRunnerOutput, TokenLogprobs
from treadle.device_copy import HostCopy, to_device
from treadle.worker.grammar import GrammarMatchers
from treadle.worker.prompt_logprobs import PromptLogprobs
from treadle.worker.request_state import PLACEHOLDER, RequestSlots
from treadle.worker.sampler import Sampler, SamplerOutput, ruled_out_error


@dataclass
class DeferredStep:
    req_ids: list[str]           # the step's requests, in its row order
    sampled_rows: np.ndarray     # which of them sampled (indices into req_ids)
    slots: np.ndarray            # each sampling request's slot
    positions: np.ndarray        # where its token goes in the slot (its PLACEHOLDER now)
    samples: SamplerOutput       # on the device, one row per sampling request
    prompt: PromptLogprobs       # the step's prompt logprobs, on the device too
    host_copy: HostCopy          # both on their way to the host, queued with the sampling
    dropped: set[int] = field(default_factory=set)   # slots whose request has left since
    output: ModelRunnerOutput | None = None          # once finished

    @classmethod
    def queue(cls, sampler: Sampler, slots: RequestSlots, grammars: GrammarMatchers,
              logits: torch.Tensor, req_ids: list[str], idx: np.ndarray, rows: np.ndarray,
              ends: np.ndarray, prompt: PromptLogprobs, previous: DeferredStep | None) -> DeferredStep:
        """Queue the sampling of the step's `rows` (indices into req_ids; `idx`: every request's
        slot; `logits`: one row per sampling request) and leave the tokens on the device: each
        sampling slot advances over a PLACEHOLDER, and every slot's computed count becomes its
        `ends` entry. `previous`: the deferred step before, if still unfinished (its tokens are
        the PLACEHOLDERs the penalties count); a constrained row's matcher must be past it."""
        slot_ids = idx[rows]
        samples = sampler.sample_slots(logits, slots, slot_ids, None,
                                       grammars.bitmask(slot_ids, [[] for _ in slot_ids]), previous)
        positions = slots.num_tokens[slot_ids].copy()
        slots.append_tokens(slot_ids, np.ones(len(slot_ids), dtype=np.int64), [PLACEHOLDER] * len(slot_ids))
        slots.num_computed_tokens[idx] = ends
        return cls(req_ids, rows, slot_ids, positions, samples, prompt,
                   HostCopy([*samples.tensors(), *prompt.tensors()]))

    def drop(self, slot: int) -> None:
        """The slot's request leaves (finished, aborted or preempted) before this step finished:
        its token is reported but never written into the slot."""
        self.dropped.add(slot)

    def _kept(self) -> np.ndarray:
        """Indices of the sampling rows whose request still holds its slot (not `dropped`)."""
        return np.flatnonzero(~np.isin(self.slots, list(self.dropped)))

    def device_tokens_for(self, token_slot: np.ndarray, positions: np.ndarray
                          ) -> tuple[np.ndarray, torch.Tensor] | None:
        """The entries (each a slot and a position: a step's input rows, or a penalty's output
        tokens) that are one of this step's tokens, and those tokens, still on the device; None
        where none is."""
        num_slots = max(int(token_slot.max(initial=0)), int(self.slots.max(initial=0))) + 1
        pending_pos = np.full(num_slots, -1, dtype=np.int64)
        pending_row = np.zeros(num_slots, dtype=np.int64)
        kept = self._kept()
        pending_pos[self.slots[kept]], pending_row[self.slots[kept]] = self.positions[kept], kept
        rows = np.flatnonzero(pending_pos[token_slot] == positions)
        if not len(rows):
            return None
        tokens = self.samples.token_ids
        return rows, tokens[to_device(pending_row[token_slot[rows]], tokens.device)]

    def finish(self, slots: RequestSlots, grammars: GrammarMatchers) -> ModelRunnerOutput:
        """Bring the tokens (and logprobs, and prompt logprobs) to the host in one wait, put the
        tokens in the slots still held by their requests, advance those slots' grammars, and
        make the step's output."""
        if self.output is not None:
            return self.output
        sample_tensors = self.samples.tensors()
        host = self.host_copy.wait()
        tokens, token_lps = self.samples.to_lists(host[:len(sample_tensors)])
        ruled_out = self.samples.rows_ruled_out(host[:len(sample_tensors)])
        kept = self._kept()
        slot_ids, positions = self.slots[kept], self.positions[kept]
        moved = slot_ids[slots.token_ids[slot_ids, positions] != PLACEHOLDER]
        assert not len(moved), f"slots {moved.tolist()} moved under a deferred token"
        slots.token_ids[slot_ids, positions] = np.asarray(tokens, dtype=np.int64)[kept]
        errors: dict[str, str] = {}
        if ruled_out or grammars.any_constrained(slot_ids):
            for k, slot, pos in zip(kept.tolist(), slot_ids.tolist(), positions.tolist()):
                r = int(self.sampled_rows[k])
                if k in ruled_out:
                    errors[self.req_ids[r]] = ruled_out_error(pos - int(slots.num_prompt_tokens[slot]))
                    slots.grammar[slot] = None   # as after a refusal: its tokens are dropped
                elif (error := grammars.accept(slot, [tokens[k]], pos)) is not None:
                    errors[self.req_ids[r]] = error
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for r, token, lp in zip(self.sampled_rows.tolist(), tokens, token_lps):
            sampled[r] = [token]
            if lp is not None:
                logprobs[self.req_ids[r]] = [lp]
        self.output = ModelRunnerOutput(
            req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
            prompt_logprobs=self.prompt.to_dict(host[len(sample_tensors):]), request_errors=errors)
        return self.output
