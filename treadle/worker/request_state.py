"""Persistent per-request slots in the model runner.

A slot is reused as requests come and go. `add` initialises every field for the new tenant,
so nothing from the previous one (its tokens, blocks, counters, seed, grammar) can leak into it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from treadle.core.scheduler_output import NewRequestData
from treadle.sampling_params import SamplingParams
from treadle.structured_output.backend import Matcher
from treadle.structured_output.reasoning import AfterReasoning

# A token of a deferred step (worker/deferred_step.py), still on the device, in its slot: never a
# token id, so an input row or a penalty count that reads it unresolved fails at once instead of
# computing on a wrong token.
PLACEHOLDER = -1

# `RequestSlots.argmax_from` of a tenant whose rows are never a plain argmax.
NEVER = np.iinfo(np.int64).max


class RequestSlots:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 num_kv_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # One table per KV cache group (core/kv_cache_groups.py): [group, slot, block].
        self.block_table = np.zeros((num_kv_groups, max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)   # the same in every group
        self.long_rope = np.zeros(max_num_reqs, dtype=bool)   # NewRequestData.long_rope
        # The output count from which the tenant's rows are a plain argmax (its min_tokens, where
        # its parameters are greedy with nothing that edits or reads the logits; else NEVER):
        # a step whose rows all are one skips building them (worker/sampler.py, `sample_slots`).
        self.argmax_from = np.full(max_num_reqs, NEVER, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        # The tenant's prompt_logprobs (how many top entries), -1 where it asked for none: a
        # step finds the few that did without a pass over every request's params.
        self.prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.seeds = [0] * max_num_reqs
        self.eos_token_ids: list[int | None] = [None] * max_num_reqs
        self.req_ids: list[str | None] = [None] * max_num_reqs
        # Grammar matchers of constrained requests, or AfterReasoning while one waits for the
        # end of the reasoning (worker/grammar.py sets them after add).
        self.grammar: list[Matcher | AfterReasoning | None] = [None] * max_num_reqs
        self.added_at_step = np.zeros(max_num_reqs, dtype=np.int64)   # when the tenant came
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData, step: int = 0) -> int:
        assert new.req_id not in self.slot_of, f"{new.req_id} already has a slot"
        slot = self._free.pop()
        n = len(new.token_ids)
        self.token_ids[slot, :n] = new.token_ids
        self.token_ids[slot, n:] = 0
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = new.num_prompt_tokens
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.block_table[:, slot] = 0
        self.num_blocks[slot] = 0
        self.append_blocks(slot, new.block_ids)
        self.long_rope[slot] = new.long_rope
        self.params[slot] = new.sampling_params
        self.argmax_from[slot] = argmax_from(new.sampling_params)
        top = new.sampling_params.prompt_logprobs
        self.prompt_logprobs[slot] = -1 if top is None else top
        self.seeds[slot] = new.generator_seed
        self.eos_token_ids[slot] = new.eos_token_id
        self.req_ids[slot] = new.req_id
        self.grammar[slot] = None
        self.added_at_step[slot] = step
        self.slot_of[new.req_id] = slot
        return slot

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return  # finished before the workers ever saw it
        self.req_ids[slot] = None
        self.params[slot] = None
        self.grammar[slot] = None
        self._free.append(slot)

    def append_blocks(self, slot: int, block_ids: list[list[int]]) -> None:
        """Append each group's new blocks (as many in every group)."""
        start = int(self.num_blocks[slot])
        for group, ids in enumerate(block_ids):
            assert len(ids) == len(block_ids[0]), "every group's table grows alike"
            self.block_table[group, slot, start:start + len(ids)] = ids
        self.num_blocks[slot] = start + len(block_ids[0])

    def null_leading_blocks(self, slot: int, num_blocks: list[int]) -> None:
        """Point the slot's first `num_blocks[g]` entries of group g's table at the null block:
        the scheduler gave those blocks back behind the sliding window, and another request may
        write them from this step on. Attention never needs them; a kernel that still reads
        them under a mask reads the null block's zeros."""
        for group, n in enumerate(num_blocks):
            self.block_table[group, slot, :n] = 0

    def append_token(self, slot: int, token_id: int) -> None:
        n = int(self.num_tokens[slot])
        self.token_ids[slot, n] = token_id
        self.num_tokens[slot] = n + 1

    def append_tokens(self, slot_ids: np.ndarray, counts: np.ndarray, token_ids: Sequence[int]) -> None:
        """Append `counts[i]` tokens to slot `slot_ids[i]` (distinct slots), taken in order from
        `token_ids`, all in one write."""
        assert len(token_ids) == counts.sum() and len(np.unique(slot_ids)) == len(slot_ids)
        offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        self.token_ids[np.repeat(slot_ids, counts),
                       np.repeat(self.num_tokens[slot_ids], counts) + offsets] = token_ids
        self.num_tokens[slot_ids] += counts

    def prompt_ids(self, slot: int) -> np.ndarray:
        return self.token_ids[slot, :self.num_prompt_tokens[slot]]

    def output_ids(self, slot: int) -> np.ndarray:
        return self.token_ids[slot, self.num_prompt_tokens[slot]:self.num_tokens[slot]]


def argmax_from(p: SamplingParams) -> int:
    """The output count from which a request's rows are a plain argmax: greedy, with nothing
    that edits its logits (a bias, a penalty, allowed or bad tokens; min_tokens until reached)
    or reads its log-probabilities. NEVER where some parameter always does."""
    plain = (p.temperature < 1e-5 and p.logprobs is None and not has_penalties(p)
             and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words_token_ids)
    return p.min_tokens if plain else NEVER


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
