"""worker/cuda_graphs.py without a GPU: the padded sizes, the persistent buffers' padding rows,
and when graphs go stale. The eager run of the same buffers is held to transformers under the
interpreter (tests/test_triton_attention.py), and the captured graphs on a GPU (`gpu` tests)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from tests.gpu import shared_gpu
from treadle import LLM
from treadle.attention.triton_backend import TritonBackend
from treadle.worker.cuda_graphs import DecodeGraphs, capture_sizes
from treadle.worker.mixed_graphs import MAX_MIXED_TOKENS, mixed_sizes


class Recorder(torch.nn.Module):
    """Stands in for the model: records the buffers each forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.seen: list[dict] = []
        self.splits: list[int] = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.splits.append(meta.num_kv_splits)
        self.seen.append({"ids": input_ids.tolist(), "positions": positions.tolist(),
                          "slots": meta.slot_mapping.tolist(), "seq_lens": meta.seq_lens.tolist(),
                          "table": meta.block_table.tolist(), "starts": meta.query_start.tolist()})
        return torch.zeros(len(input_ids), 3)


def test_mixed_sizes():
    assert mixed_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert mixed_sizes(100) == [16, 32, 64, 100] and mixed_sizes(8192)[-1] == MAX_MIXED_TOKENS


def test_a_mixed_steps_padding_is_a_request_of_its_own_that_writes_nothing():
    """A step of a 2-token chunk beside a decode, padded to 16 tokens, then a step of one
    request: the padding tokens are one more request (positions 0, slots -1, the null block's
    row, its own length), the requests after it empty, and nothing of the first step's third
    request is left where the second step's padding request reads."""
    model = Recorder()
    graphs = DecodeGraphs(model, [], max_batch=2, max_blocks=3, device=torch.device("cpu"),
                          capture=False, mixed_tokens=32, max_reqs=3)
    mixed = graphs.mixed
    table = np.array([[5, 6, 0], [7, 0, 0]])
    out = mixed.run(np.array([11, 12, 13]), np.array([40, 2, 3]), np.array([90, 114, 115]),
                    np.array([1, 2]), np.array([41, 4]), table)
    assert out.shape == (3, 3)
    mixed.run(np.array([21, 22]), np.array([1, 2]), np.array([81, 82]), np.array([2]),
              np.array([3]), table[1:, :1])
    first, second = model.seen
    assert first == {"ids": [11, 12, 13] + [0] * 13, "positions": [40, 2, 3] + [0] * 13,
                     "slots": [90, 114, 115] + [-1] * 13, "seq_lens": [41, 4, 13, 0],
                     "starts": [0, 1, 3, 16, 16], "table": table.tolist() + [[0] * 3] * 2}
    assert second["starts"] == [0, 2, 16, 16, 16] and second["seq_lens"] == [3, 14, 0, 0]
    assert second["table"][0][0] == 7 and second["table"][1] == [0, 0, 0]   # the padding's row
    assert second["slots"] == [81, 82] + [-1] * 14 and second["positions"] == [1, 2] + [0] * 14
    assert mixed.padded_size(17, 3) == 32 and mixed.padded_size(33, 1) is None
    assert mixed.padded_size(8, 4) is None   # more requests than max_num_seqs: never scheduled
    assert (mixed.num_steps, mixed.num_replays) == (2, 0)
    mixed.fill_padding(32)   # as captured: every token the padding request's
    assert len(model.seen) == 2 and mixed.seq_lens.tolist() == [32, 0, 0, 0]
    assert mixed.query_start.tolist() == [0, 32, 32, 32, 32] and not mixed.positions.any()


def test_capture_sizes_are_vllms():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(1) == [1]


def test_padding_rows_write_nothing_and_read_the_null_block():
    """A step of 4 decodes, then one of 3 padded to 4: the fourth row is padding again, never
    the slot of the request that left (its write would land in a block now someone else's)."""
    model = Recorder()
    graphs = DecodeGraphs(model, [], max_batch=8, max_blocks=3, device=torch.device("cpu"),
                          capture=False)
    table = np.array([[5, 6, 0], [7, 0, 0], [8, 9, 10], [11, 0, 0]])
    out = graphs.run(np.array([1, 2, 3, 4]), np.array([20, 5, 40, 9]), np.array([84, 117, 136, 185]),
                     np.array([21, 6, 41, 10]), table)
    assert out.shape == (4, 3)
    graphs.run(np.array([1, 2, 3]), np.array([21, 6, 41]), np.array([85, 118, 137]),
               np.array([22, 7, 42]), table[:3])
    first, second = model.seen
    assert first["slots"] == [84, 117, 136, 185] and first["starts"] == [0, 1, 2, 3, 4]
    assert second == {"ids": [1, 2, 3, 0], "positions": [21, 6, 41, 0], "slots": [85, 118, 137, -1],
                      "seq_lens": [22, 7, 42, 1], "table": table[:3].tolist() + [[0, 0, 0]],
                      "starts": [0, 1, 2, 3, 4]}
    assert graphs.padded_size(5) == 8 and graphs.padded_size(9) is None
    assert graphs.num_steps == 2


def ranges(seq_lens: np.ndarray, num_splits: int, min_tokens: int) -> list[int]:
    """The key ranges each sequence takes (triton_decode.py's rule)."""
    return np.minimum(np.maximum(seq_lens // min_tokens, 1), num_splits).tolist()


@pytest.mark.parametrize("max_batch", [40, 20])
def test_a_padded_step_cuts_every_sequence_as_an_eager_step_would(max_batch):
    """A step of n decodes replays the graph of its padded size: its split count must give each
    sequence the key ranges an eager step of n gives it, so that the sums run in one order.
    (Before, 5 decodes padded to 8 took 8 ranges a sequence where eagerly they took 12.)"""
    backend = TritonBackend(torch.device("cpu"), 16)
    model = Recorder()
    graphs = DecodeGraphs(model, [], max_batch=max_batch, max_blocks=80, device=torch.device("cpu"),
                          capture=False, backend=backend)
    rng = np.random.default_rng(0)
    split_steps = 0
    for n in range(1, max_batch + 1):
        seq_lens = rng.integers(2, 1200, n)   # a decode has a token before it
        seq_lens[0] = 1200   # one long enough to split at every count
        ctx, q_lens = seq_lens - 1, np.ones(n, np.int64)
        table = np.zeros((n, 80), np.int64)
        eager = backend.build_metadata(q_lens, ctx, ctx, table).num_kv_splits
        graphs.run(np.zeros(n, np.int64), ctx, np.full(n, -1), seq_lens, table)
        replayed = model.splits[-1]
        assert (replayed > 1) == (eager > 1), n
        if eager > 1:
            split_steps += 1
            assert (ranges(seq_lens, replayed, backend.split_min_tokens)
                    == ranges(seq_lens, eager, backend.split_min_tokens)), n
    assert split_steps == min(max_batch, backend.split_max_decodes)


def test_graphs_go_stale_when_their_tensors_move():
    model = Recorder()
    cache = [torch.zeros(4)]
    graphs = DecodeGraphs(model, cache, max_batch=2, max_blocks=1, device=torch.device("cpu"),
                          capture=False)
    assert graphs.valid_for(model, cache)
    model.weight.data.copy_(torch.ones(2))   # an update in place keeps the address
    assert graphs.valid_for(model, cache)
    model.weight.data = torch.ones(2)        # new storage: a replay would read the old one
    assert not graphs.valid_for(model, cache)
    assert not graphs.valid_for(Recorder(), cache)


@pytest.mark.parametrize("args", [{}, {"enforce_eager": True}])
def test_no_graphs_where_they_cannot_serve(llama, args):
    """On the CPU nothing is captured, whatever enforce_eager says."""
    with LLM(llama, dtype="float32", num_kv_blocks=16, block_size=16, **args) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.graphs is None and not runner.on_device.captures_graphs
        assert llm.engine.config.enforce_eager == bool(args)


# -- on a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
def test_graphs_follow_sleep_and_weight_updates(tiny_checkpoints):
    """Sleep gives the device back the KV cache and the graphs that read it; after wake_up
    (cache and weights given new memory) the graphs are captured again; after a weight update,
    a replay computes with the new weights."""
    from tests.family_support import PretrainedReference, greedy_ids

    path = tiny_checkpoints["qwen3"]
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]
    with LLM(path, device="cuda", attention_backend="triton", dtype="float32", block_size=16,
             max_num_seqs=4, **shared_gpu("cuda")) as llm:
        runner = llm.engine.core.executor.worker.runner
        want = [PretrainedReference(path).greedy(p, 16) for p in prompts]
        assert greedy_ids(llm, prompts, 16) == want
        # Weak references only: holding the old graphs would hold the cache they read (the
        # first run of this test on an H200 did, and wake_up found no memory for a new one).
        held = [weakref.ref(t) for t in [runner.graphs, *runner.kv_caches]]
        cache_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        reserved = torch.cuda.memory_reserved()
        llm.sleep(level=1)
        assert runner.graphs is None
        gc.collect()
        assert all(ref() is None for ref in held), "the graphs or a KV cache tensor outlived sleep"
        # What sleep gave back, not what is left: this xdist worker's earlier tests hold memory
        # of their own (654 MB after sleep on the H200, where the cache was 1 GiB).
        assert reserved - torch.cuda.memory_reserved() >= cache_bytes
        llm.wake_up()
        assert runner.graphs is not None
        assert greedy_ids(llm, prompts, 16) == want
        name = "model.layers.1.mlp.down_proj.weight"
        weight = dict(runner.model.named_parameters())[name].detach().cpu()
        changed = {name: weight * 1.5}
        llm.update_weights(changed.items())
        steps = runner.graphs.num_steps
        assert greedy_ids(llm, prompts, 16) == [PretrainedReference(path, changed).greedy(p, 16)
                                                for p in prompts]
        assert runner.graphs.num_steps > steps
