"""The trainer's end of a weight transfer: rank 0 of the group the engine's workers join.

    sender = WeightSender(world_size=1 + engine_world_size)   # hosts the store; its port is known
    # The engine's init blocks until the trainer connects: call it from a thread (or over HTTP).
    join = threading.Thread(target=llm.init_weight_transfer_engine,
                            args=({"init_info": sender.init_info},))
    join.start(); sender.connect(); join.join()

    # Each round (pause generation first while requests run):
    llm.start_weight_update()
    update = threading.Thread(target=llm.update_weights,
                              args=({"update_info": sender.update_info(weights, packed=True)},))
    update.start(); sender.send(weights, packed=True); update.join()
    llm.finish_weight_update(weight_version=step)

A trainer may broadcast each tensor itself, in the order of update_info's names (unpacked):
`torch.distributed.broadcast(tensor, group=sender.group, group_src=0)`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from treadle.distributed.weight_transfer import (DEFAULT_PACKED_BUFFER_SIZE_BYTES, TransferGroup,
                                                 dtype_name, pack, packed_chunks)

logger = logging.getLogger(__name__)


class WeightSender:
    def __init__(self, world_size: int, master_address: str = "127.0.0.1", master_port: int = 0,
                 *, backend: str = "gloo", timeout_s: float = 300.0,
                 device: torch.device | str | None = None) -> None:
        """Host the group's store at master_address:master_port (0: a free port). world_size:
        1 (the trainer) + every engine worker. backend: "gloo" (tensors go from the host) or
        "nccl" (from `device`, a GPU)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl":
            device = torch.device(device if device is not None else "cuda")
        self._group = TransferGroup(backend, master_address, master_port, 0, world_size,
                                    timeout_s, torch.device(device) if device is not None else None)
        self.master_address = master_address
        self.world_size = world_size
        self._declared: list[dict[str, Any]] = []   # update_infos made here, not yet sent

    @property
    def init_info(self) -> dict[str, Any]:
        """init_weight_transfer_engine's init_info for an engine whose workers follow the
        trainer (rank_offset 1), with this end's timeout for theirs."""
        return {"master_address": self.master_address, "master_port": self._group.port,
                "rank_offset": 1, "world_size": self.world_size,
                "timeout": self._group.timeout.total_seconds()}

    def connect(self) -> None:
        """Wait (up to timeout_s) for every worker to join."""
        self._group.connect()
        logger.info("weight sender: %d workers joined", self.world_size - 1)

    @property
    def group(self) -> dist.ProcessGroup:
        """The group, for a trainer that broadcasts by itself (group_src=0)."""
        if self._group.group is None:
            raise RuntimeError("not connected: call connect() first")
        return self._group.group

    def update_info(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                    packed: bool = False,
                    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
                    ) -> dict[str, Any]:
        """update_weights' update_info for these tensors; send() must then be given the same."""
        info = _describe(list(named_tensors), packed, packed_buffer_size_bytes)
        self._declared.append(info)
        del self._declared[:-16]   # a trainer broadcasting by itself never sends them
        return info

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, packed: bool = False,
             packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES) -> int:
        """Broadcast the tensors, as update_info(same arguments) describes them; returns how
        many. Raises ValueError, sending nothing, where update_info was called here and
        declared none like them: the workers receive what was declared, and gloo aborts a
        worker's process on a longer message than it expects. Raises if a worker is gone or
        the timeout passes."""
        pairs = list(named_tensors)
        info = _describe(pairs, packed, packed_buffer_size_bytes)
        if self._declared:
            if info not in self._declared:
                declared = self._declared[-1]
                key = next(k for k in ("packed", "packed_buffer_size_bytes", "names", "dtype_names",
                                       "shapes") if info.get(k) != declared.get(k))
                raise ValueError("send() was given other tensors or arguments than update_info "
                                 f"declared ({key}: {_difference(declared.get(key), info.get(key))}); "
                                 "nothing was sent")
            self._declared.remove(info)
        tensors = [t for _, t in pairs]
        if not packed:
            for tensor in tensors:   # one at a time: no second copy of the model on the way
                self.broadcast(tensor)
            return len(tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        for chunk in packed_chunks(sizes, packed_buffer_size_bytes):
            self._group.broadcast(pack(tensors[i] for i in chunk).to(self._group.device))
        return len(tensors)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """One tensor to every worker (unpacked rounds send each listed tensor in turn)."""
        self._group.broadcast(tensor.detach().to(self._group.device).contiguous())

    def close(self) -> None:
        self._group.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _describe(pairs: list[tuple[str, torch.Tensor]], packed: bool,
              packed_buffer_size_bytes: int) -> dict[str, Any]:
    info: dict[str, Any] = {"names": [n for n, _ in pairs],
                            "dtype_names": [dtype_name(t.dtype) for _, t in pairs],
                            "shapes": [list(t.shape) for _, t in pairs], "packed": packed}
    if packed:
        info["packed_buffer_size_bytes"] = packed_buffer_size_bytes
    return info


def _difference(declared: Any, given: Any) -> str:
    """Where two values of update_info differ, in words."""
    if isinstance(declared, list) and isinstance(given, list) and len(declared) == len(given):
        i = next(i for i, (a, b) in enumerate(zip(declared, given)) if a != b)
        return f"item {i} is {given[i]!r}, declared {declared[i]!r}"
    return f"{given!r}, declared {declared!r}"
