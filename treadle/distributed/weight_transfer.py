"""Weights broadcast from a trainer process to the engine's workers: vLLM's weight-transfer
protocol (its names and request shapes), the parts both ends share.

The trainer and every worker form a process group of their own, apart from the workers'
torch.distributed group (which pipeline and tensor parallelism use): the trainer is rank 0 and
hosts the group's store at `master_address:master_port`; worker rank r joins as
`rank_offset + r`. gloo carries it on CPU, NCCL on CUDA.

A round is `start_weight_update`, one or more `update_weights(update_info)`, then
`finish_weight_update`. Each update_info lists `names`, `dtype_names` and `shapes`. Unpacked, the
trainer broadcasts each tensor in the order of `names`, so a trainer calling
`torch.distributed.broadcast(tensor, group=group, group_src=0)` itself takes part as well as
`treadle.rl.WeightSender` does. Packed (`packed: true`), consecutive tensors travel as one flat
uint8 buffer: a buffer takes tensors until it holds more than `packed_buffer_size_bytes` (the
tensor crossing the limit included), as vLLM packs them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from treadle.validate import check_seconds

logger = logging.getLogger(__name__)

# The dtypes a weight may travel in; it is cast to the model's dtype when applied.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30   # vLLM's default
DEFAULT_PACKED_NUM_BUFFERS = 2
# Keys of this group in the trainer's store, apart from anything else the trainer keeps there.
STORE_PREFIX = "treadle-weight-transfer/"
# torch.distributed takes a group's size and ranks as C ints, and its deadlines overflow past
# about 292 years; a tensor's bytes must fit an int64.
MAX_WORLD_SIZE = 2**31 - 1
MAX_TIMEOUT_S = 365 * 24 * 3600.0
MAX_TENSOR_BYTES = 2**63 - 1


def dtype_name(dtype: torch.dtype) -> str:
    """The name a dtype travels under in update_info (`torch.bfloat16` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class InitInfo:
    """`init_weight_transfer_engine`'s init_info: where the trainer's store is, where this
    engine's workers sit in the group, and (ours) a timeout in seconds for each step."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout: float | None = None

    @classmethod
    def parse(cls, init_info: Any) -> InitInfo:
        """Raises ValueError naming the field that is missing or wrong."""
        fields = _fields_of("init_info", init_info, cls)
        for name in ("master_address", "master_port", "rank_offset", "world_size"):
            if name not in fields:
                raise ValueError(f"init_info.{name} is required")
        info = cls(**fields)
        if (not isinstance(info.master_address, str) or not info.master_address
                or not info.master_address.isprintable()):
            raise ValueError(f"init_info.master_address must be a host name or address, got "
                             f"{info.master_address!r}")
        if not _is_int(info.master_port) or not 0 < info.master_port < 65536:
            raise ValueError(f"init_info.master_port must be in 1..65535, got {info.master_port!r}")
        if not _is_int(info.rank_offset) or not 1 <= info.rank_offset < MAX_WORLD_SIZE:
            raise ValueError(f"init_info.rank_offset must be an integer in 1..{MAX_WORLD_SIZE - 1} "
                             f"(the trainer is rank 0), got {info.rank_offset!r}")
        if not _is_int(info.world_size) or not 2 <= info.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"init_info.world_size must be an integer in 2..{MAX_WORLD_SIZE}, "
                             f"got {info.world_size!r}")
        if info.timeout is not None:
            check_seconds("init_info.timeout", info.timeout)
            if info.timeout > MAX_TIMEOUT_S:
                raise ValueError(f"init_info.timeout must be at most {MAX_TIMEOUT_S:.0f} seconds "
                                 f"(a year), got {info.timeout!r}")
        return info


@dataclass(frozen=True)
class UpdateInfo:
    """`update_weights`' update_info. `is_checkpoint_format` is vLLM's (treadle always takes
    transformers-named weights); `weight_version` is ours: it names the weights the round makes,
    unless finish_weight_update names them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    is_checkpoint_format: bool = True
    weight_version: Any = None

    @classmethod
    def parse(cls, update_info: Any) -> UpdateInfo:
        """Raises ValueError naming the field (and the weight) that is missing or wrong."""
        fields = _fields_of("update_info", update_info, cls)
        for name in ("names", "dtype_names", "shapes"):
            if name not in fields:
                raise ValueError(f"update_info.{name} is required")
            if not isinstance(fields[name], (list, tuple)):
                raise ValueError(f"update_info.{name} must be a list, got "
                                 f"{type(fields[name]).__name__}")
        info = cls(**fields)
        n = len(info.names)
        for name in ("dtype_names", "shapes"):
            if len(getattr(info, name)) != n:
                raise ValueError(f"update_info.{name} has {len(getattr(info, name))} entries, "
                                 f"update_info.names has {n}")
        for i, (name, dtype, shape) in enumerate(zip(info.names, info.dtype_names, info.shapes)):
            if not isinstance(name, str) or not name:
                raise ValueError(f"update_info.names[{i}] must be a weight's name, got {name!r}")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise ValueError(f"update_info.dtype_names[{i}] ({name!r}) is {dtype!r}; a "
                                 f"weight travels as one of {', '.join(DTYPES)}")
            if (not isinstance(shape, (list, tuple))
                    or not all(_is_int(d) and d >= 0 for d in shape)):
                raise ValueError(f"update_info.shapes[{i}] ({name!r}) must be a list of sizes "
                                 f">= 0, got {shape!r}")
            if math.prod(shape) * DTYPES[dtype].itemsize > MAX_TENSOR_BYTES:
                raise ValueError(f"update_info.shapes[{i}] ({name!r}) is {list(shape)}: more "
                                 f"than {MAX_TENSOR_BYTES} bytes, past any tensor")
        if not isinstance(info.packed, bool):
            raise ValueError(f"update_info.packed must be true or false, got {info.packed!r}")
        for name in ("packed_buffer_size_bytes", "packed_num_buffers"):
            value = getattr(info, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"update_info.{name} must be an integer >= 1, got {value!r}")
        if info.is_checkpoint_format is not True:
            raise ValueError("update_info.is_checkpoint_format must be true: treadle takes "
                             "weights by their transformers names, as in the checkpoint")
        return dataclasses.replace(info, names=list(info.names), dtype_names=list(info.dtype_names),
                                   shapes=[[int(d) for d in s] for s in info.shapes])

    def tensors(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor, in the order they are broadcast."""
        return [(n, DTYPES[d], tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]

    def chunks(self) -> list[range]:
        """Which tensors travel together: one each unpacked, else as packed_chunks says."""
        if not self.packed:
            return [range(i, i + 1) for i in range(len(self.names))]
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in self.tensors()]
        return packed_chunks(sizes, self.packed_buffer_size_bytes)


def packed_chunks(sizes: list[int], buffer_size_bytes: int) -> list[range]:
    """The tensors (by index) of each packed buffer: a buffer takes tensors until it holds more
    than `buffer_size_bytes`, the one that crosses the limit included (vLLM's rule)."""
    chunks, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_size_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def pack(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Tensors as one flat uint8 buffer, each tensor's bytes in turn."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: torch.Tensor, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a packed buffer laid out as `layout` says."""
    offset = 0
    for name, dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        piece = buffer[offset:offset + size]
        if offset % dtype.itemsize:   # a view of another dtype must start on its alignment
            piece = piece.clone()
        offset += size
        yield name, piece.view(dtype).reshape(shape)


class TransferGroup:
    """The trainer's and the workers' process group; rank 0 (the trainer) sends. It is built
    from a TCPStore and the backend's ProcessGroup directly, so it never touches a process's
    default torch.distributed group."""

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int,
                 world_size: int, timeout_s: float, device: torch.device | None = None) -> None:
        """Rank 0 hosts the store; every rank then waits (up to timeout_s) for all the others."""
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device if device is not None else torch.device("cpu")
        self._store: dist.TCPStore | None = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=self.timeout,
            wait_for_workers=False)
        self.port = self._store.port
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        """Join the group: returns once every rank has joined."""
        store = dist.PrefixStore(STORE_PREFIX, self._store)
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        elif self.backend == "nccl":
            self.group = _nccl_group(store, self.rank, self.world_size, self.timeout, self.device)
        else:
            raise ValueError(f"unknown weight transfer backend {self.backend!r}")
        # The first collective sets up the connections: fail here, not in the first round.
        self.broadcast(torch.zeros(1, device=self.device))

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From rank 0 into `tensor` on every other rank; raises when a peer is gone or the
        timeout passes."""
        if self.group is None:
            raise RuntimeError("the weight transfer group is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self.group.broadcast([tensor], opts).wait()
        if tensor.is_cuda:   # NCCL's wait orders the stream; a failure shows on synchronize
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        group, self.group, self._store = self.group, None, None
        if group is not None:
            try:
                group.shutdown()
            except Exception as e:   # a group broken by a dead peer may refuse a clean shutdown
                logger.debug("weight transfer group shutdown: %s", e)


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
                device: torch.device) -> dist.ProcessGroup:
    if not dist.is_nccl_available():
        raise RuntimeError("weight_transfer_config.backend 'nccl' needs a torch built with NCCL")
    if device.index is not None:   # NCCL binds the communicator to the current device
        torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def _fields_of(what: str, value: Any, cls: type) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{what} has unknown fields {unknown}; known: {sorted(known)}")
    return dict(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
