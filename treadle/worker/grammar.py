"""Grammar matchers beside the sampler, one per constrained request slot, and the token bitmask.

The rule that keeps masks exact under async scheduling and pipeline stages: a row's mask is
built from its slot's matcher just before that row is sampled, and a matcher advances only
here, with tokens this runner has accepted (samples, and drafts that survived verification).
The runner holds every token the moment it is sampled, before the engine core sees it, so no
mask is ever built without a token that precedes it: "in flight" means on its way to the
engine core, never on its way to this sampler. Drafts are matched tentatively and rolled back.

A grammar that waits for the end of the reasoning (structured_output/reasoning.py) sits in its
slot as an `AfterReasoning`: its rows are free, its drafts stop short of the end tag, and the
token that completes the tag puts the matcher itself in the slot, so the next row is masked.
Under deferred steps that token may still be on the device when the next row is sampled: the
row then gets the grammar's first mask, applied there only where the token ends the reasoning,
so a waiting grammar never makes a step wait for the one before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import NewRequestData
from treadle.device_copy import to_device
from treadle.structured_output.backend import GrammarBackend, Matcher
from treadle.structured_output.compile_ahead import CompileAhead
from treadle.structured_output.reasoning import AfterReasoning
from treadle.structured_output.registry import get_backend
from treadle.worker.request_state import PLACEHOLDER, RequestSlots

logger = logging.getLogger(__name__)


@dataclass
class GrammarMask:
    """The packed masks of a step's sampling rows under a grammar (bit t: token t allowed)."""
    bitmask: torch.Tensor   # one row for each entry of `rows`
    rows: list[int]         # the sampling rows they mask
    # Masks that hold only where the slot's last token, still on the device (a deferred step's),
    # is the one that ends the reasoning: (index into `rows`, slot, position, that token).
    if_token_ends: list[tuple[int, int, int, int]] = field(default_factory=list)


class GrammarMatchers:
    def __init__(self, config: TreadleConfig, slots: RequestSlots) -> None:
        self.config = config
        self.slots = slots
        self._backend: GrammarBackend | None = None
        self.ahead = CompileAhead(lambda: self.backend)   # Worker.warm_grammar starts these

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:   # in-process, the engine core's: its compile cache is warm
            model = self.config.model
            self._backend = get_backend(self.config.structured_outputs.backend, model.model,
                                        model.vocab_size)
        return self._backend

    def attach(self, slot: int, new: NewRequestData) -> None:
        """A matcher for a new tenant, past the output it already has (resumed after preemption)."""
        params = new.sampling_params.structured_outputs
        if params is None:
            return
        stop_ids = ([new.eos_token_id] if new.eos_token_id is not None else []) + \
            list(new.sampling_params.stop_token_ids)
        matcher = self.backend.matcher(self.ahead.compiled(params), stop_ids)
        output = [int(t) for t in new.token_ids[new.num_prompt_tokens:]]
        if new.grammar_waits_for:
            waiting = AfterReasoning(matcher, new.grammar_waits_for)
            at = waiting.feed(output)
            if at is None:
                self.slots.grammar[slot] = waiting
                return
            output = output[at + 1:]
        for t in output:
            # Not reachable from a request: a matcher accepted each of these tokens before (a
            # refused token is never output, accept() ends its request), so a replay cannot fail.
            accepted = matcher.accept(t)
            assert accepted, f"{new.req_id}: its own output token {t} breaks its grammar"
        self.slots.grammar[slot] = matcher

    def any_constrained(self, slot_ids: np.ndarray) -> bool:
        """Whether any of these slots has a grammar (a matcher, or one waiting for the reasoning)."""
        grammar = self.slots.grammar
        return any(grammar[s] is not None for s in slot_ids.tolist())

    def waits_for_tokens(self, slot_ids: np.ndarray) -> bool:
        """Whether any of these slots' next mask needs its last token on the host: a matcher
        advances there. A grammar still waiting for the end of the reasoning does not: whether
        that token ends it is checked on the device (`bitmask`)."""
        return any(isinstance(self.slots.grammar[int(s)], Matcher) for s in slot_ids)

    def _ends_on_device(self, slot: int, waiting: AfterReasoning) -> tuple[int, int] | None:
        """(position, token) where the slot's last token is still on the device and ends the
        reasoning if it is that token."""
        position = int(self.slots.num_tokens[slot]) - 1
        if self.slots.token_ids[slot, position] != PLACEHOLDER:
            return None
        token = waiting.token_that_ends()
        return None if token is None else (position, token)

    def bitmask(self, slot_ids: np.ndarray, drafts: list[list[int]]) -> GrammarMask | None:
        """Masks for the sampling rows (1 + k per request, k drafts); None when no row is
        constrained. Rows past a request's first draft the grammar refuses stay free:
        verification stops at that draft, so their samples are never kept."""
        if not self.any_constrained(slot_ids):
            return None   # most steps: one pass, nothing built
        matchers: list[Matcher | None] = []
        # row: the waiting grammar whose first mask it takes, and (slot, position, token)
        ends_on_device: dict[int, tuple[AfterReasoning, int, int, int]] = {}
        first = 0
        for s, d in zip(slot_ids, drafts):
            matcher = self.slots.grammar[s]
            if isinstance(matcher, AfterReasoning):
                if (end := self._ends_on_device(int(s), matcher)) is not None:
                    assert not d, "steps verifying drafts read no token on the device"
                    ends_on_device[first] = (matcher, int(s), *end)
                    matcher = matcher.matcher   # at the grammar's start
                else:
                    matcher = None
            matchers.append(matcher)
            first += len(d) + 1
        if all(m is None for m in matchers):
            return None
        bitmask = self.backend.allocate_bitmask(sum(len(d) + 1 for d in drafts))
        rows: list[int] = []
        first = 0
        for matcher, d in zip(matchers, drafts):
            if first in ends_on_device:
                waiting = ends_on_device[first][0]
                if waiting.first_mask is None:
                    waiting.first_mask = self.backend.allocate_bitmask(1)
                    matcher.fill_bitmask(waiting.first_mask, 0)
                bitmask[first] = waiting.first_mask[0]
                rows.append(first)
            # A terminated matcher (EOS accepted, its request ending): an async step's leftover.
            elif matcher is not None and not matcher.is_terminated():
                k = matcher.valid_prefix(d)
                for j in range(k + 1):
                    matcher.fill_bitmask(bitmask, first + j)
                    rows.append(first + j)
                    if j < k:
                        matcher.accept(d[j])
                matcher.rollback(k)
            first += len(d) + 1
        # A row that allows no token (a dead end: regex a[^\s\S]b after "a") stays free, so that
        # its sample is well defined; accept() then refuses it and ends the request.
        allowed = bitmask[rows].ne(0).any(dim=1).tolist() if rows else []
        rows = [r for r, some in zip(rows, allowed) if some]
        if not rows:
            return None
        return GrammarMask(bitmask[rows], rows,
                           [(i, *ends_on_device[r][1:]) for i, r in enumerate(rows) if r in ends_on_device])

    def accept(self, slot: int, token_ids: list[int], position: int) -> str | None:
        """Advance a slot's matcher past its accepted tokens, the first of them at `position`
        in the slot. A token its grammar refuses ends the request: returns why (the request's
        error), and the slot is constrained no more, as the scheduler drops its tokens from
        now on."""
        matcher = self.slots.grammar[slot]
        if isinstance(matcher, AfterReasoning):
            if (at := matcher.feed(token_ids)) is None:
                return None
            matcher = self.slots.grammar[slot] = matcher.matcher
            token_ids, position = token_ids[at + 1:], position + at + 1
        if matcher is None or matcher.is_terminated():
            return None
        for i, t in enumerate(token_ids):
            if matcher.is_terminated():
                break   # an accepted draft stopped it: the scheduler ends the output there
            if not matcher.accept(t):
                self.slots.grammar[slot] = None
                return self._refusal(slot, matcher, t, position + i)
        return None

    def _refusal(self, slot: int, matcher: Matcher, token_id: int, position: int) -> str:
        num_output = position - int(self.slots.num_prompt_tokens[slot])
        row = self.backend.allocate_bitmask(1)
        matcher.fill_bitmask(row, 0)
        if not row.any():
            return (f"structured_outputs cannot be satisfied: its grammar allows no token after "
                    f"{num_output} output token(s)")
        # The mask allowed tokens, yet the sampled one is not among them: an engine bug, which
        # still ends only this request.
        logger.error("slot %d: sampled token %d outside its grammar's mask", slot, token_id)
        return f"sampled token {token_id} outside its grammar's mask"

    def valid_drafts(self, slot: int, drafts: list[int]) -> list[int]:
        """`drafts` cut at the first one the grammar refuses: it could never be accepted."""
        matcher = self.slots.grammar[slot]
        if matcher is None or not drafts:
            return drafts
        if isinstance(matcher, AfterReasoning):
            # Free up to the end tag; the row after the draft that completes it would need the
            # grammar's mask, so that draft is not proposed.
            at = matcher.completed_at(drafts)
            return drafts if at is None else drafts[:at]
        return drafts[:matcher.valid_prefix(drafts)]


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarMask,
                        ended: torch.Tensor | None = None) -> None:
    """Set the logits of tokens a row's mask forbids to -inf, in place. `ended`: for each of
    `mask.if_token_ends`, on the device, whether its token ended the reasoning (its mask holds
    only then).

    The mask travels to the logits' device packed, 32 tokens to an int32 word (a 32nd of the
    unpacked size), and is unpacked there."""
    device = logits.device
    packed = to_device(mask.bitmask, device)   # from pinned memory: no wait for the GPU
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((packed[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    if mask.if_token_ends:
        assert ended is not None and len(ended) == len(mask.if_token_ends)
        at = to_device([i for i, *_ in mask.if_token_ends], device, torch.int64)
        allowed[at] |= ~ended[:, None]   # still reasoning: the row is free
    index = to_device(mask.rows, device, torch.int64)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
