"""KV cache sizing on a GPU by profiling (worker/memory_profile.py): the arithmetic and its
errors, the profile step through the real model runner on the CPU, and on a GPU the whole
start-up: the cache is what gpu_memory_utilization leaves, and memory held by someone else at
start-up stops it with the numbers."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.reference import HFReference
from treadle import LLM, SamplingParams
from treadle.config import EngineArgs
from treadle.worker.memory_profile import GiB, MiB, MemoryProfile, profile_batch, run_profile_step


def test_the_kv_cache_is_what_the_share_leaves():
    profile = MemoryProfile(total=80 * GiB, free_at_start=79 * GiB, held_after_load=2 * GiB,
                            peak_activations=GiB)
    assert profile.kv_cache_bytes(0.9) == int(80 * GiB * 0.9) - 3 * GiB
    assert profile.kv_cache_bytes(0.5) == 37 * GiB
    assert "KV cache 69.00 GiB" in profile.describe(0.9)


def test_the_decode_graphs_pool_comes_out_of_the_share_too():
    profile = MemoryProfile(total=80 * GiB, free_at_start=79 * GiB, held_after_load=2 * GiB,
                            peak_activations=GiB, graph_pool=GiB // 2)
    assert profile.kv_cache_bytes(0.9) == int(80 * GiB * 0.9) - 3 * GiB - GiB // 2
    assert "CUDA graphs 0.50 GiB, KV cache 68.50 GiB" in profile.describe(0.9)
    tight = MemoryProfile(total=16 * GiB, free_at_start=16 * GiB, held_after_load=2 * GiB,
                          peak_activations=GiB, graph_pool=GiB)
    assert tight.kv_cache_bytes(0.3125) == GiB   # 5 GiB: the graphs fit, with a GiB to spare
    with pytest.raises(ValueError, match=r"needs 1\.00 GiB more, and the CUDA graphs "
                                         r"1\.00 GiB \(enforce_eager=True does without them\)"):
        tight.kv_cache_bytes(0.2)


def test_memory_held_by_another_process_stops_start_up_with_the_numbers():
    profile = MemoryProfile(total=80 * GiB, free_at_start=60 * GiB, held_after_load=2 * GiB,
                            peak_activations=GiB)
    with pytest.raises(ValueError, match=r"asks for 72\.00 GiB of the device's 80\.00 GiB, but "
                                         r"only 60\.00 GiB were free at start-up: other processes "
                                         r"hold 20\.00 GiB\. Lower gpu_memory_utilization to at "
                                         r"most 0\.75"):
        profile.kv_cache_bytes(0.9)
    assert profile.kv_cache_bytes(0.75) == 57 * GiB


def test_a_share_too_small_for_the_model_says_what_to_change():
    profile = MemoryProfile(total=16 * GiB, free_at_start=16 * GiB, held_after_load=3 * GiB,
                            peak_activations=2 * GiB)
    with pytest.raises(ValueError, match=r"0\.25 \(4\.00 GiB\) leaves nothing for the KV cache: "
                                         r"the loaded model holds 3\.00 GiB and a step at its "
                                         r"largest needs 2\.00 GiB more"):
        profile.kv_cache_bytes(0.25)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_out_of_range_is_refused(llama, value):
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\], got {value}"):
        EngineArgs(model=llama, gpu_memory_utilization=value).create_config()


@pytest.mark.parametrize("num_tokens, max_num_seqs", [(2048, 256), (100, 7), (5, 256)])
def test_the_profile_step_is_the_largest_step_the_scheduler_can_give(num_tokens, max_num_seqs):
    step, num_blocks = profile_batch(num_tokens, max_num_seqs, block_size=16)
    lengths = [len(r.token_ids) for r in step.scheduled_new_reqs]
    assert sum(lengths) == step.total_num_scheduled_tokens == num_tokens
    assert len(lengths) == min(num_tokens, max_num_seqs) and max(lengths) - min(lengths) <= 1
    assert set(step.num_in_flight_tokens) == set(step.num_scheduled_tokens)   # all sample
    blocks = [b for r in step.scheduled_new_reqs for b in r.block_ids[0]]
    assert sorted(blocks) == list(range(1, num_blocks))   # the null block is not taken
    assert all(len(r.block_ids[0]) * 16 >= len(r.token_ids) for r in step.scheduled_new_reqs)


def test_the_profile_step_runs_the_real_model_and_leaves_the_runner_as_it_was(llama):
    """On the CPU the step runs through the runner's own path at the scheduler's largest size
    (its memory is measured only on a GPU); afterwards the engine serves exactly."""
    prompt = list(range(100, 140))
    with LLM(llama, dtype="float32", num_kv_blocks=24, block_size=16, max_num_batched_tokens=96,
             max_num_seqs=8) as llm:
        runner = llm.engine.core.executor.worker.runner
        num_blocks = runner.num_blocks
        run_profile_step(runner)
        assert runner.kv_caches == []
        runner.init_kv_cache(num_blocks)
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == HFReference(llama).greedy(prompt, 12)


# -- on a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_a_gpu_the_kv_cache_takes_what_the_share_leaves(llama, caplog):
    free, total = torch.cuda.mem_get_info()
    with caplog.at_level(logging.INFO, logger="treadle"):   # the profile's and the worker's
        with LLM(llama, device="cuda", dtype="float32", gpu_memory_utilization=0.5) as llm:
            assert llm.engine.core.executor.worker.runner.attention.name == "triton"   # the default
            blocks = llm.engine.core.executor.num_blocks
            per_block = llm.engine.config.cache.bytes_per_block(llm.engine.config.model)
            out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                               SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
            worker = llm.engine.core.executor.worker
            profiled, captured = worker.memory_profile.graph_pool, worker.graph_pool
            torch.cuda.empty_cache()   # what torch keeps for reuse is in the profile's peak
            held = free - torch.cuda.mem_get_info()[0]
    assert any("GPU memory:" in r.message for r in caplog.records)
    assert any("CUDA graphs hold" in r.message for r in caplog.records)
    # The tiny model's weights and steps take little: nearly all of the half goes to the cache.
    assert 0.4 * total < blocks * per_block <= 0.5 * total, (blocks * per_block / GiB, total / GiB)
    # The graphs were counted, as the capture for good then took them (within a few of the
    # allocator's 2 MiB segments), and the engine, graphs and cache together stayed within
    # its share (but for kernels first loaded by the generate, after the profile).
    assert 0 < profiled and abs(captured - profiled) <= max(4 * MiB, profiled // 4), (
        captured / MiB, profiled / MiB)
    assert held <= 0.5 * total + 64 * MiB, (held / GiB, total / GiB)


@pytest.mark.gpu
def test_on_a_gpu_without_graphs_none_are_counted(llama):
    with LLM(llama, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
             enforce_eager=True) as llm:
        worker = llm.engine.core.executor.worker
        assert worker.runner.graphs is None
        assert worker.memory_profile.graph_pool == 0 and worker.graph_pool == 0


@pytest.mark.gpu
def test_on_a_gpu_memory_held_at_start_up_is_named(llama):
    free, total = torch.cuda.mem_get_info()
    held = torch.empty(int(free - 0.6 * total), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(ValueError, match=r"other processes hold .* GiB\. Lower "
                                             r"gpu_memory_utilization to at most 0\.[56]"):
            LLM(llama, device="cuda", dtype="float32", gpu_memory_utilization=0.9)
    finally:
        del held
        torch.cuda.empty_cache()
