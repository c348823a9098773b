"""Who this worker is among the workers, and the collectives a model shard needs.

Rank layout, as in vLLM: rank = pp_rank * tp_size + tp_rank. The tp_size ranks of one pipeline
stage form its tensor-parallel group (all-reduce, all-gather). Traffic between stages runs
point to point on the world group (distributed/pipeline.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from treadle.config import ParallelConfig

# How long a rank waits for its peers at start-up before giving up with an error.
INIT_TIMEOUT = datetime.timedelta(seconds=60)
# How long an operation may wait for a peer. A peer that dies breaks the connection at once;
# this only bounds a peer that hangs, and a long prefill step must fit well inside it.
OP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class ParallelContext:
    rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None   # this stage's tensor-parallel process group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, pp_rank: int, tp_rank: int | None = None) -> int:
        """The world rank at `pp_rank` holding the same tensor shard as this one (or `tp_rank`)."""
        return pp_rank * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def layer_range(self, num_layers: int) -> range:
        """This stage's layers: an even split, the first stages taking one more when uneven."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=-1)


def output_rank(parallel: ParallelConfig) -> int:
    """The rank whose step results the engine reads: the last stage's first shard."""
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


def init_parallel(parallel: ParallelConfig, rank: int, host: str, port: int,
                  device: str) -> ParallelContext:
    """Join the process group (the engine hosts its store) and build this rank's groups."""
    world_size = parallel.world_size
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=INIT_TIMEOUT)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=OP_TIMEOUT)
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    ctx = ParallelContext(rank=rank, tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp)
    for stage in range(pp):   # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
        if stage == ctx.pp_rank:
            ctx.tp_group = group
    return ctx
