"""How a stage before the last one learns the tokens the last stage sampled.

Every stage runs every step and keeps the same bookkeeping: which requests, in what order,
how many tokens computed. Only the last stage samples. Its tokens for a step come back later,
while this stage may already be running the next steps, so they are taken in step order when
they are needed:
  - before a step, until every request in it has the tokens its chunk reads as input (a decode
    reads the token sampled in an earlier step);
  - and every step older than the batch queue's depth, whose tokens are certainly sent (the
    engine has read its result), so nothing piles up.
A step's tokens go to a slot only if the slot's tenant held it at that step: a request
resumed since then brought its tokens with it, and a finished one needs none.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from treadle.distributed.pipeline import StageLink
from treadle.worker.request_state import RequestSlots


class SampledInbox:
    def __init__(self, link: StageLink, depth: int) -> None:
        self.link = link
        self.depth = depth   # steps the engine keeps in flight at most
        # Sampling steps run here whose tokens have not come back: (step, requests in the
        # order the last stage sends their tokens).
        self.pending: deque[tuple[int, list[str]]] = deque()

    def expect(self, step: int, req_ids: list[str]) -> None:
        if req_ids:   # a step in which nothing samples sends nothing (invariant 4)
            self.pending.append((step, req_ids))

    def receive_for(self, step: int, slots: RequestSlots, idx: np.ndarray,
                    ends: np.ndarray) -> None:
        """Before `step`: take old steps' tokens, then whatever this step's chunks still need
        (the tokens up to `ends` of each slot in `idx`)."""
        while self.pending and self.pending[0][0] <= step - self.depth:
            self._receive_one(slots)
        while (slots.num_tokens[idx] < ends).any():
            assert self.pending, "a chunk needs tokens that no step in flight samples"
            self._receive_one(slots)

    def drain(self, slots: RequestSlots) -> None:
        """Take every step's tokens now: the profile step's (worker/memory_profile.py), whose
        slots are about to go."""
        while self.pending:
            self._receive_one(slots)

    def _receive_one(self, slots: RequestSlots) -> None:
        step, req_ids = self.pending.popleft()
        for rid, token in zip(req_ids, self.link.recv_sampled(len(req_ids))):
            slot = slots.slot_of.get(rid)
            if slot is not None and slots.added_at_step[slot] <= step:
                slots.append_token(slot, token)
