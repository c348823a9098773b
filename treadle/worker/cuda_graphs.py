"""CUDA graphs of the decode step: a step of n one-token decodes replays a graph captured at the
smallest padded batch size >= n, instead of launching every kernel of the model from Python.

A graph replays fixed addresses, so the step's inputs live in persistent buffers: token ids,
positions (RoPE rows), slot mapping, sequence lengths and block table, each copied in before
the replay, and the hidden states come out in the graph's own output tensor. The graphs are
captured from the largest size down into one shared memory pool, after the KV cache exists.
Rows past n are padding that can do no harm: a one-token "decode" of token 0 at position 0
whose slot is -1 (nothing written) and whose block table is the null block (finite zeros read).

Only the `triton` attention backend can be captured: its metadata is device tensors and its
grids are upper bounds from shapes, with no value read back (attention/triton_backend.py).
Where the backend would cut a step's decodes into key ranges (the split-KV path, for a few long
sequences), the step replays a second graph of its size, captured with the backend's largest
split count for that size: each sequence takes its ranges from its own length on the device
(attention/triton_decode.py), so one graph serves every length, and the host only picks which
graph to replay. The count is the padded size's, which the backend keeps equal to that of
the step's own count (`TritonBackend.batch_splits`), so a replay sums each sequence's keys in
the order an eager step would. (A change to the backend's split settings takes a recapture.)
Mixed steps (prefill chunks, drafts) replay graphs of their own, captured first into the same
pool (worker/mixed_graphs.py). Sampling stays outside the graph. Anything that moves the
captured tensors (the KV cache freed by sleep, weights moved to the host and back, parameters
given new storage) drops the graphs: `valid_for` sees it, and the runner captures again.

With `capture=False` the same buffers and padding run eagerly: how the CPU tests hold this
path to transformers under Triton's interpreter, where no graph can be captured.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Callable

import numpy as np
import torch

from treadle.attention.triton_backend import TritonBackend, TritonMetadata
from treadle.device_copy import copy_padded, host_tensor, to_device
from treadle.worker.mixed_graphs import MixedGraphs

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes, as vLLM's: 1, 2, 4, then every multiple of 8, up to max_batch
    (itself included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture's warm-up runs on, for the whole process: torch hands out
    its streams in turn from a pool of 32, and cuBLAS keeps a workspace for each stream it runs
    on, for good (32 MiB on an H100); a new stream per capture would add one each time the
    graphs are captured again (the profile's capture, then for good, then after each
    wake_up), uncounted by the KV sizing."""
    device = torch.device(device)
    if device not in _warmup_streams:
        _warmup_streams[device] = torch.cuda.Stream(device)
    return _warmup_streams[device]


def tensor_addresses(model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
    """Where every tensor a graph reads lives: the graphs stay valid while this is unchanged."""
    tensors = [*model.parameters(), *model.buffers(), *kv_caches]
    return tuple(t.data_ptr() for t in tensors)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 max_blocks: int, device: torch.device, capture: bool = True,
                 backend: TritonBackend | None = None, mixed_tokens: int = 0,
                 max_reqs: int = 0) -> None:
        """`backend`: the attention backend whose split-KV choice the graphs follow (none: they
        never split). With `mixed_tokens`, graphs of mixed steps too, of up to that many tokens
        over up to `max_reqs` requests (`mixed`: worker/mixed_graphs.py)."""
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.backend = backend
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.addresses = tensor_addresses(model, kv_caches)
        as_long = dict(dtype=torch.int64, device=device)
        as_int = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, **as_long)
        self.positions = torch.zeros(max_batch, **as_long)
        self.slot_mapping = torch.full((max_batch,), -1, **as_int)
        self.seq_lens = torch.ones(max_batch, **as_int)
        self.query_start = torch.arange(max_batch + 1, **as_int)   # one token per request
        self.block_table = torch.zeros(max_batch, max_blocks, **as_int)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.split_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}   # split-KV
        self.num_split_steps = 0   # of num_steps, those whose decodes took the split-KV path
        self.num_steps = 0   # decode steps served (replayed, or run eagerly on the buffers)
        self.capture_s = 0.0   # how long capturing them all took
        self.mixed = (MixedGraphs(model, kv_caches, mixed_tokens, max_reqs, max_blocks, device)
                      if mixed_tokens > 0 else None)
        if capture:
            self._capture_all()

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds num_reqs decodes; None past the largest."""
        if num_reqs > self.max_batch:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def valid_for(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> bool:
        return (model is self.model and kv_caches is self.kv_caches
                and tensor_addresses(model, kv_caches) == self.addresses)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, block_table: np.ndarray,
            patch: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor:
        """The model's hidden states for n one-token decodes ([n, hidden]); the arrays are the
        step's, one entry (or block-table row) per decode. `patch`: rows whose input token is
        on the device already (a deferred step's: worker/deferred_step.py), and those tokens."""
        n = len(input_ids)
        size = self.padded_size(n)
        assert size is not None, f"{n} decodes, more than the largest graph ({self.max_batch})"
        self._fill(n, size, input_ids, positions, slot_mapping, seq_lens, block_table)
        if patch is not None:
            self.input_ids[to_device(patch[0], self.device)] = patch[1]
        splits = (self._splits(size) if self.backend is not None
                  and self.backend.kv_splits(seq_lens) > 1 else 1)
        self.num_steps += 1
        self.num_split_steps += splits > 1
        graphs = self.split_graphs if splits > 1 else self.graphs
        if size in graphs:
            graph, out = graphs[size]
            graph.replay()
        else:
            out = self._forward(size, splits)
        return out[:n]

    def _splits(self, size: int) -> int:
        """The split count of a step of this padded size whose decodes split: the backend's
        most for that many decodes, padding included (a padding row takes one range)."""
        return self.backend.batch_splits(size) if self.backend is not None else 1

    # -- inside ------------------------------------------------------------------------------
    def _fill(self, n: int, size: int, input_ids: np.ndarray, positions: np.ndarray,
              slot_mapping: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray) -> None:
        """Copy the step into the buffers' first n rows and padding into rows n..size, the
        padding made on the host: a copy a buffer, and no fill launched on the device."""
        width = min(block_table.shape[1], self.block_table.shape[1])
        for buffer, values, pad in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                    (self.slot_mapping, slot_mapping, -1),
                                    (self.seq_lens, seq_lens, 1)):
            copy_padded(buffer, values, size, pad)
        # A padding row reads one key, through its first entry: the null block.
        table = np.zeros((size, width), np.int32)
        table[:n] = block_table[:, :width]
        self.block_table[:size, :width].copy_(host_tensor(table, self.device), non_blocking=True)

    def _metadata(self, size: int, splits: int) -> TritonMetadata:
        min_tokens = self.backend.split_min_tokens if self.backend is not None else 1
        return TritonMetadata(self.slot_mapping[:size], size, self.block_table[:size],
                              self.seq_lens[:size], self.query_start[:size + 1], splits, None,
                              min_tokens)

    def _forward(self, size: int, splits: int = 1) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self._metadata(size, splits))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = warmup_stream(self.device)
        # The largest first, mixed steps' before decodes': the pool fits all.
        for size in sorted(self.mixed.sizes if self.mixed is not None else [], reverse=True):
            self.mixed.fill_padding(size)
            self.mixed.graphs[size] = self._capture(partial(self.mixed.forward, size), pool, side)
        for size in sorted(self.sizes, reverse=True):
            self._fill(0, size, *(np.zeros(0, np.int64) for _ in range(4)),
                       np.zeros((0, 1), np.int64))
            self.graphs[size] = self._capture(partial(self._forward, size), pool, side)
            if (splits := self._splits(size)) > 1:
                self.split_graphs[size] = self._capture(partial(self._forward, size, splits),
                                                        pool, side)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch 1..%d; %d more split-KV) and %d of "
                    "mixed steps (up to %d tokens) in %.1fs", len(self.graphs), self.max_batch,
                    len(self.split_graphs), len(self.mixed.graphs) if self.mixed else 0,
                    self.mixed.max_tokens if self.mixed else 0, self.capture_s)

    def _capture(self, forward: Callable[[], torch.Tensor], pool, side: torch.cuda.Stream
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of `forward`, and its output; the warm-up runs on `side`, off the capture
        stream, as torch asks."""
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Only this thread's calls are checked: a connector's thread may synchronize its own
        # stream while a weight update recaptures, which the global mode would refuse.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = forward()
        return graph, out
