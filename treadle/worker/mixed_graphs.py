"""CUDA graphs of mixed steps: prefill chunks, 1 + k draft verification and decodes together,
as the unified attention kernel takes them in one launch (attention/triton_unified.py). An
eager step launches every kernel of the model from Python (15.6 ms a step on the H200's host,
whatever its size); a replay launches one graph.

A step of T tokens replays the graph captured at the smallest token size >= T (`mixed_sizes`).
Requests are not padded per graph: every graph has room for `max_reqs` + 1 of them, since the
kernel's grid is an upper bound from the buffers' shapes, and a request with no tokens returns
from its one query block at once. The padding tokens T..size are one more request of their
own: a chunk with no context, whose slots are -1 (nothing written), whose block table row is
the null block (finite zeros read) and whose positions are 0 (the RoPE table may be shorter
than a graph: causality comes from the lengths, not the positions), so every row the graph
computes is finite. The step's own requests keep their query blocks, numbered as in an eager
launch, so attention computes their rows as the eager unified launch does; what differs from
an eager step is that no decode takes the split-KV path here (a long decode beside a chunk
walks its keys in one program per KV head, still far cheaper than an eager step's launches).

DecodeGraphs (worker/cuda_graphs.py) owns one of these and captures its graphs, first, into
its pool; with `capture=False` the same buffers and padding run eagerly (the CPU tests).
"""

from __future__ import annotations

import numpy as np
import torch

from treadle.attention.triton_backend import TritonMetadata
from treadle.device_copy import copy_padded, host_tensor, to_device

# Steps of more tokens run eagerly: their compute dwarfs the launches, and a graph's pool
# would hold their activations for good.
MAX_MIXED_TOKENS = 2048


def mixed_sizes(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 32, ..., 512, then every multiple of 512, up to max_tokens
    (itself included), at most MAX_MIXED_TOKENS."""
    top = min(max_tokens, MAX_MIXED_TOKENS)
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s < top] + list(range(1024, top, 512))
    return sizes + [top]


class MixedGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_tokens: int,
                 max_reqs: int, max_blocks: int, device: torch.device) -> None:
        """Buffers for steps of up to `max_tokens` tokens over up to `max_reqs` requests; the
        graphs of `forward` at each size go into `graphs` (DecodeGraphs captures them)."""
        assert max_reqs > 0, "a mixed step has a request at least"
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = mixed_sizes(max_tokens)
        self.max_tokens, self.max_reqs = self.sizes[-1], max_reqs
        as_long = dict(dtype=torch.int64, device=device)
        as_int = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(self.max_tokens, **as_long)
        self.positions = torch.zeros(self.max_tokens, **as_long)
        self.slot_mapping = torch.full((self.max_tokens,), -1, **as_int)
        # One row more than max_reqs: the padding tokens' request.
        self.seq_lens = torch.zeros(max_reqs + 1, **as_int)
        self.query_start = torch.zeros(max_reqs + 2, **as_int)
        # Wide enough for the padding request too, whose chunk may reach further than a
        # request of max_model_len (all of a graph's tokens, at capture).
        reach = -(-self.max_tokens // kv_caches[0].shape[2]) if kv_caches else 0
        self.block_table = torch.zeros(max_reqs + 1, max(max_blocks, reach), **as_int)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_steps = 0   # mixed steps served (replayed, or run eagerly on the buffers)
        self.num_replays = 0   # of them, those that replayed a graph
        self.num_patched = 0   # of them, those with input tokens from a deferred step

    def padded_size(self, num_tokens: int, num_reqs: int) -> int | None:
        """The smallest size that holds a step of num_tokens over num_reqs requests; None
        where the step is too large for any."""
        if num_tokens > self.max_tokens or num_reqs > self.max_reqs:
            return None
        return next(s for s in self.sizes if s >= num_tokens)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            query_lens: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
            patch: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor:
        """The model's hidden states for the step's T tokens ([T, hidden]): its per-token
        arrays (ids, RoPE positions, slots), per-request query lengths, sequence lengths and
        block-table rows, in the step's order. `patch`: rows whose input token is on the
        device already (a deferred step's: worker/deferred_step.py), and those tokens."""
        num_tokens = len(input_ids)
        size = self.padded_size(num_tokens, len(query_lens))
        assert size is not None, f"a step of {num_tokens} tokens, {len(query_lens)} requests"
        self._fill(size, input_ids, positions, slot_mapping, query_lens, seq_lens, block_table)
        if patch is not None:
            self.input_ids[to_device(patch[0], self.device)] = patch[1]
            self.num_patched += 1
        self.num_steps += 1
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            self.num_replays += 1
        else:
            out = self.forward(size)
        return out[:num_tokens]

    def fill_padding(self, size: int) -> None:
        """The buffers as a step of no request of its own: `size` padding tokens (capture)."""
        empty = np.zeros(0, np.int64)
        self._fill(size, empty, empty, empty, empty, empty, np.zeros((0, 1), np.int64))

    def forward(self, size: int) -> torch.Tensor:
        """The model over the buffers' first `size` tokens (what a graph captures)."""
        meta = TritonMetadata(self.slot_mapping[:size], 0, self.block_table, self.seq_lens,
                              self.query_start, 1, None)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    # -- inside ------------------------------------------------------------------------------
    def _fill(self, size: int, input_ids: np.ndarray, positions: np.ndarray,
              slot_mapping: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
              block_table: np.ndarray) -> None:
        """Copy the step into the buffers, and make tokens num_tokens..size the padding
        request's (see the module's docstring)."""
        n, r = len(input_ids), len(query_lens)
        for buffer, values, pad in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                    (self.slot_mapping, slot_mapping, -1)):
            copy_padded(buffer, values, size, pad)
        # Requests past the padding one are empty: no tokens, no keys.
        lens = np.zeros(self.max_reqs + 1, np.int32)
        lens[:r] = seq_lens
        lens[r] = size - n
        starts = np.full(self.max_reqs + 2, size, np.int32)
        starts[0] = 0
        starts[1:r + 1] = np.cumsum(query_lens)
        self.seq_lens.copy_(host_tensor(lens, self.device), non_blocking=True)
        self.query_start.copy_(host_tensor(starts, self.device), non_blocking=True)
        if r:
            width = min(block_table.shape[1], self.block_table.shape[1])
            self.block_table[:r, :width].copy_(
                host_tensor(np.ascontiguousarray(block_table[:, :width], dtype=np.int32),
                            self.device), non_blocking=True)
        self.block_table[r] = 0
