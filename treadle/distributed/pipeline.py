"""Traffic between pipeline stages, point to point on the world group.

Forward: each step's hidden states go from a stage to the next one (the rank with the same
tensor shard). They are sent without waiting, so a stage can start its next step while the
next stage computes this one: chunks of a long prompt flow through the stages like
micro-batches.

Back: the last stage sends the tokens it sampled to every earlier stage, which needs them as
inputs to later steps. A step in which nothing samples (every request a non-final prefill
chunk) sends none, and no stage waits for any. Every stage reads that from the same
SchedulerOutput, so sender and receivers always agree (invariant 4).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from treadle.distributed.parallel_state import ParallelContext

HIDDEN_TAG = 1
SAMPLED_TAG = 2


class StageLink:
    def __init__(self, ctx: ParallelContext, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.prev = None if ctx.is_first_stage else ctx.rank_of(ctx.pp_rank - 1)
        self.next = None if ctx.is_last_stage else ctx.rank_of(ctx.pp_rank + 1)
        self.last = ctx.rank_of(ctx.pp_size - 1)
        self.earlier = [ctx.rank_of(s) for s in range(ctx.pp_rank)] if ctx.is_last_stage else []
        # Sends not yet completed, with their tensors, which must live until then.
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        # Sampled-token messages, counted for tests and stats: sent (per step, to all earlier
        # stages) on the last stage, received on the others.
        self.num_sampled_sends = 0
        self.num_sampled_recvs = 0
        self.recv_wait_s = 0.0   # time spent waiting for the other stages

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self._isend(hidden.contiguous(), self.next, HIDDEN_TAG)

    def recv_hidden(self, num_tokens: int) -> torch.Tensor:
        buf = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        dist.recv(buf, self.prev, tag=HIDDEN_TAG)
        self.recv_wait_s += time.perf_counter() - start
        return buf

    def send_sampled(self, token_ids: list[int]) -> None:
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        for rank in self.earlier:
            self._isend(tokens, rank, SAMPLED_TAG)
        self.num_sampled_sends += 1

    def recv_sampled(self, num_tokens: int) -> list[int]:
        buf = torch.empty(num_tokens, dtype=torch.int64)
        start = time.perf_counter()
        dist.recv(buf, self.last, tag=SAMPLED_TAG)
        self.recv_wait_s += time.perf_counter() - start
        self.num_sampled_recvs += 1
        return buf.tolist()

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(tensor, dst, tag=tag), tensor))
