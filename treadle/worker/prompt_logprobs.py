"""Prompt logprobs of a step, for every request that asked, in one batch on the device.

Position p of a prompt scores token p + 1, so a chunk covering positions first..stop-1 of the
prompt gives the logprobs of tokens first + 1..stop. Every such row of the step, whichever
request it belongs to, goes through the head, the log-softmax and `batched_logprobs` together;
the results stay on the device until the step's one wait (`to_host` in the runner), where they
come down with the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.scheduler_output import TokenLogprobs
from treadle.device_copy import to_device
from treadle.worker.request_state import RequestSlots
from treadle.worker.sampler import BatchedLogprobs, batched_logprobs


@dataclass
class PromptLogprobs:
    # (request, the first token it scores, how many rows of `batch` are its), in row order;
    # a request whose chunk scores no prompt token has none.
    spans: list[tuple[str, int, int]]
    batch: BatchedLogprobs | None

    def tensors(self) -> list[torch.Tensor]:
        return self.batch.tensors() if self.batch is not None else []

    def to_dict(self, host: list[torch.Tensor] | None = None) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Per request, (first token scored, its logprobs); `host`: `tensors()` on the host."""
        lists = self.batch.to_lists(host) if self.batch is not None else []
        out, k = {}, 0
        for rid, first, n in self.spans:
            out[rid] = (first, lists[k:k + n])
            k += n
        return out


def queue_prompt_logprobs(model: torch.nn.Module, slots: RequestSlots, hidden: torch.Tensor,
                          req_ids: list[str], idx: np.ndarray, starts: np.ndarray,
                          q_lens: np.ndarray, ctx: np.ndarray) -> PromptLogprobs:
    """The step's prompt logprobs, queued on the device. `hidden`: the step's rows (request i's
    chunk from row starts[i], q_lens[i] rows, at positions from ctx[i])."""
    spans: list[tuple[str, int, int]] = []
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    num_top: list[int] = []
    for i in np.flatnonzero(slots.prompt_logprobs[idx] >= 0).tolist():
        rid, slot = req_ids[i], int(idx[i])
        top = int(slots.prompt_logprobs[slot])
        first = int(ctx[i])
        stop = min(first + int(q_lens[i]), int(slots.num_prompt_tokens[slot]) - 1)
        n = max(0, stop - first)
        spans.append((rid, first + 1, n))
        rows.append(np.arange(int(starts[i]), int(starts[i]) + n))
        targets.append(slots.token_ids[slot, first + 1:first + 1 + n])
        num_top += [top] * n
    if not num_top:
        return PromptLogprobs(spans, None)
    device = hidden.device
    logits = model.compute_logits(hidden[to_device(np.concatenate(rows), device, torch.int64)])
    lps = torch.log_softmax(logits.float(), dim=-1)
    return PromptLogprobs(spans, batched_logprobs(lps, to_device(np.concatenate(targets), device, torch.int64),
                                                  num_top))
