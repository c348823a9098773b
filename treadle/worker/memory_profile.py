"""How much of a GPU the KV cache gets, found by profiling, as vLLM does it.

`gpu_memory_utilization` (default 0.9) is the share of the whole device this engine may use.
The worker reads the free memory before it takes any, loads the model, then runs one step as
large as the scheduler can ever give it (`max_num_batched_tokens` prompt tokens over up to
`max_num_seqs` requests, each sampling) on a throwaway KV cache, and captures the CUDA graphs
(decode and mixed steps) there too, where they will serve, to measure their memory pool. The
KV cache is what is left:

    total * utilization - (what the worker holds after loading) - (the step's peak activations)
                        - (the CUDA graphs' pool)

The graphs are captured twice, then: on the throwaway cache to be measured, and for good once
the real cache exists (their addresses are the cache's). Their pool depends on the batch sizes,
not on the cache's size, so the first capture measures the second (the worker logs both). What
a first capture pays once and keeps (cuBLAS workspaces, kernels loaded) counts as held.

Memory other processes held at start-up is not ours to take: when less than
`total * utilization` was free then, start-up stops with the numbers and what to change,
instead of an out-of-memory error later in some step.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from treadle.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from treadle.sampling_params import SamplingParams

if TYPE_CHECKING:
    from treadle.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 2 ** 30
MiB = 2 ** 20


@dataclass(frozen=True)
class MemoryProfile:
    """One worker's GPU memory, in bytes.

    total: the device's memory.
    free_at_start: free when the worker started; the rest was other processes' (and the CUDA
        context's).
    held_after_load: what the worker holds once the model is loaded, the profile step has
        run and the profile's graphs are let go, torch's cache emptied: the weights,
        workspaces, kernels loaded, the runtime's own.
    peak_activations: how far the profile step's allocations rose above where they started.
    graph_pool: what the CUDA graphs hold (their memory pool, and the driver's own for
        the graphs): what letting them go gave back; 0 where no graphs serve.
    """

    total: int
    free_at_start: int
    held_after_load: int
    peak_activations: int
    graph_pool: int = 0

    def kv_cache_bytes(self, utilization: float) -> int:
        """What is left for the KV cache; ValueError, with the numbers, where nothing is."""
        requested = int(self.total * utilization)
        if self.free_at_start < requested:
            raise ValueError(
                f"gpu_memory_utilization {utilization} asks for {requested / GiB:.2f} GiB of the "
                f"device's {self.total / GiB:.2f} GiB, but only {self.free_at_start / GiB:.2f} GiB "
                f"were free at start-up: other processes hold "
                f"{(self.total - self.free_at_start) / GiB:.2f} GiB. Lower gpu_memory_utilization "
                f"to at most {self.free_at_start / self.total:.2f}, or stop what holds the memory")
        kv_bytes = requested - self.held_after_load - self.peak_activations - self.graph_pool
        if kv_bytes <= 0:
            graphs = (f", and the CUDA graphs {self.graph_pool / GiB:.2f} GiB "
                      "(enforce_eager=True does without them)" if self.graph_pool else "")
            raise ValueError(
                f"gpu_memory_utilization {utilization} ({requested / GiB:.2f} GiB) leaves nothing "
                f"for the KV cache: the loaded model holds {self.held_after_load / GiB:.2f} GiB "
                f"and a step at its largest needs {self.peak_activations / GiB:.2f} GiB more"
                f"{graphs}; raise gpu_memory_utilization, or lower max_num_batched_tokens or "
                "max_num_seqs")
        return kv_bytes

    def describe(self, utilization: float) -> str:
        return (f"{self.total / GiB:.2f} GiB device x {utilization} = "
                f"{self.total * utilization / GiB:.2f} GiB: model and runtime "
                f"{self.held_after_load / GiB:.2f} GiB, peak activations "
                f"{self.peak_activations / GiB:.2f} GiB, CUDA graphs "
                f"{self.graph_pool / GiB:.2f} GiB, KV cache "
                f"{self.kv_cache_bytes(utilization) / GiB:.2f} GiB (others held "
                f"{(self.total - self.free_at_start) / GiB:.2f} GiB at start-up)")


def free_device_memory(device: torch.device) -> int:
    """The GPU's free memory, once this process's own garbage is given back: an engine closed
    or dropped earlier in the process (its tensors in a reference cycle, or in torch's cache)
    is not another process's memory."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def profile_batch(num_tokens: int, max_num_seqs: int, block_size: int, num_groups: int = 1
                  ) -> tuple[SchedulerOutput, int]:
    """A step of `num_tokens` prompt tokens over min(max_num_seqs, num_tokens) requests that
    all sample, on blocks 1.. of a throwaway cache; and how many blocks that cache needs (the
    null block included). Every KV cache group takes the same blocks: what they write is
    thrown away."""
    num_reqs = min(max_num_seqs, num_tokens)
    lengths = np.full(num_reqs, num_tokens // num_reqs)
    lengths[:num_tokens % num_reqs] += 1
    new_reqs, next_block = [], 1
    for i, n in enumerate(lengths.tolist()):
        num_blocks = -(-n // block_size)
        new_reqs.append(NewRequestData(
            req_id=f"profile-{i}", token_ids=[0] * n, num_prompt_tokens=n,
            sampling_params=SamplingParams(max_tokens=1), num_computed_tokens=0,
            block_ids=[list(range(next_block, next_block + num_blocks))] * num_groups,
            generator_seed=i))
        next_block += num_blocks
    ids = [r.req_id for r in new_reqs]
    step = SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=dict(zip(ids, lengths.tolist())), total_num_scheduled_tokens=num_tokens,
        num_in_flight_tokens=dict.fromkeys(ids, 1))
    return step, next_block


def run_profile_step(runner: ModelRunner) -> int:
    """The largest step the scheduler can give, through the runner's own step path, on a
    throwaway KV cache; the runner is left with no KV cache and no requests. Returns the
    throwaway cache's size in blocks."""
    config = runner.config
    step, num_blocks = profile_batch(config.scheduler.max_num_batched_tokens,
                                     config.scheduler.max_num_seqs, config.cache.block_size,
                                     config.cache.kv_groups.num_groups)
    runner.init_kv_cache(num_blocks)
    runner.execute_profile_step(step)
    if runner.inbox is not None:   # a stage before the last: the tokens sent back to it
        runner.inbox.drain(runner.slots)
    runner.free_kv_cache()
    return num_blocks


def _free_memory(device: torch.device) -> int:
    """The device's free memory once its queued work is done and torch's cache is emptied:
    what torch holds for blocks in use only, none for blocks it keeps for reuse."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def measure_graph_capture(runner: ModelRunner) -> int:
    """Capture the runner's CUDA graphs for good, on its KV cache, and return how much device
    memory that took (the free memory before less after, torch's cache emptied on both sides,
    so that what the warm-up passes borrowed and gave back is not counted). After the
    profile's capture this is the graphs' own memory: what a first capture pays once (cuBLAS
    workspaces, kernels loaded) is paid already."""
    free_before = _free_memory(runner.device)
    runner.capture_graphs()
    return max(0, free_before - _free_memory(runner.device))


def profile_graph_pool(runner: ModelRunner, num_blocks: int) -> int:
    """The CUDA graphs' memory (0 where no graphs serve): captured on a throwaway KV cache of
    `num_blocks`, it is what letting them go gives back. What the capture paid once and keeps
    (cuBLAS workspaces, kernels loaded) is not the graphs': it stays, and the caller counts it
    as held. The runner is left with no KV cache."""
    if not runner.serves_graphs:
        return 0
    runner.init_kv_cache(num_blocks)
    try:
        runner.capture_graphs()
        with_graphs = _free_memory(runner.device)
        runner.graphs = None   # the graphs go, and their pool with the last reference to it
        gc.collect()
        return max(0, _free_memory(runner.device) - with_graphs)
    finally:
        runner.free_kv_cache()


def profile_memory(runner: ModelRunner, free_at_start: int) -> MemoryProfile:
    """Run the profile step on the runner's GPU, capture its CUDA graphs, and measure what
    they and the model take."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_blocks = run_profile_step(runner)
    torch.cuda.synchronize(device)
    # The throwaway cache counts in the peak; it is small (one step's blocks), and erring
    # that way leaves the KV cache smaller, never the device short.
    peak = torch.cuda.max_memory_allocated(device) - before
    graph_pool = profile_graph_pool(runner, num_blocks)
    free_now, total = _free_memory(device), torch.cuda.mem_get_info(device)[1]
    profile = MemoryProfile(total=total, free_at_start=free_at_start,
                            held_after_load=free_at_start - free_now, peak_activations=peak,
                            graph_pool=graph_pool)
    logger.info("GPU memory: %s", profile.describe(runner.config.cache.gpu_memory_utilization))
    return profile
