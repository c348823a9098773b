"""Block stores for KV tiers: the interface a tier's worker side moves blocks through, the
host-memory store behind `OffloadingConnector`, the scheduler side's LRU index of it, and the
copies between the device cache and host memory.

A store keeps whole blocks, [layers, 2, block_size, kv_heads, head_dim], under the keys of
`block_store.py`, each with its CRC32. Saving is two calls, so that only the first has to finish
before the device cache is written again: `put` copies the block out of the cache, `seal`
checksums it and makes it loadable. A networked store (Redis) would implement the same four
calls: put into a host buffer, seal by checksum and SET, get by GET and verify.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections import OrderedDict
from typing import Sequence

import torch

from treadle.kv_transfer.block_store import crc32


class CopyStream:
    """Copies between the device's KV cache and host memory.

    On CUDA they are non-blocking, on a stream of their own: `after_compute` orders them after
    the step's kernels (which wrote the KV) and `before_compute` orders the next kernels after
    them, without the host waiting for either. Elsewhere (CPU) the same calls make plain
    synchronous copies, and the ordering calls do nothing: the caller's threads order them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def after_compute(self) -> None:
        """Later copies read what the kernels issued so far (on the calling thread) wrote."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def before_compute(self) -> None:
        """Kernels issued later (on the calling thread) see the copies issued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            dst.copy_(src, non_blocking=self.stream is not None)

    def synchronize(self) -> None:
        """The host waits for the copies issued so far."""
        if self.stream is not None:
            self.stream.synchronize()


class KVBlockStore(abc.ABC):
    """Where a KV tier keeps blocks by key (the worker side's view)."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `key` is stored and sealed."""

    @abc.abstractmethod
    def put(self, key: str, layers: Sequence[torch.Tensor]) -> bool:
        """Copy a block out of the cache, one [2, block_size, kv_heads, head_dim] view per layer;
        False if there is no room. Not loadable before `seal`."""

    @abc.abstractmethod
    def seal(self, key: str) -> None:
        """Checksum what `put` copied; from now on `get` may load it."""

    @abc.abstractmethod
    def get(self, key: str, layers: Sequence[torch.Tensor]) -> None:
        """Copy a sealed block into the cache's views, its checksum verified first; KeyError if
        it is not stored, ValueError if it is damaged."""

    @abc.abstractmethod
    def discard(self, key: str) -> None:
        """Drop `key`, if stored."""


class HostMemoryStore(KVBlockStore):
    """Blocks in one host buffer of `num_slots` blocks, allocated once (pinned, for a GPU's
    non-blocking copies; on CPU its pages are taken as blocks are first written). Which keys it
    holds is the scheduler's decision (`LRUBlockIndex`): this store only refuses a put past its
    size. `put` and `seal` may run on another thread than `get` and `discard`."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.buffer = torch.empty((num_slots, *block_shape), dtype=dtype,
                                  pin_memory=device.type == "cuda")
        self.block_bytes = self.buffer[0].numel() * self.buffer.element_size()
        self.copies = CopyStream(device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._crc: dict[str, int] = {}   # of sealed keys
        self._lock = threading.Lock()
        self.peak_bytes = 0   # the most it ever held

    @property
    def bytes_used(self) -> int:
        return len(self._slot) * self.block_bytes

    def contains(self, key: str) -> bool:
        return key in self._crc

    def put(self, key: str, layers: Sequence[torch.Tensor]) -> bool:
        with self._lock:
            if key in self._slot:
                return True
            if not self._free:
                return False
            slot = self._slot[key] = self._free.pop()
            self.peak_bytes = max(self.peak_bytes, self.bytes_used)
        for layer, src in enumerate(layers):
            self.copies.copy(self.buffer[slot, layer], src)
        return True

    def seal(self, key: str) -> None:
        self.copies.synchronize()   # the copies `put` issued have landed in host memory
        with self._lock:
            slot = self._slot.get(key)
        if slot is None:
            return   # discarded meanwhile
        crc = crc32(self.buffer[slot])
        with self._lock:
            if self._slot.get(key) == slot:
                self._crc[key] = crc

    def get(self, key: str, layers: Sequence[torch.Tensor]) -> None:
        with self._lock:
            slot, expected = self._slot.get(key), self._crc.get(key)
        if slot is None or expected is None:
            raise KeyError(f"{key[:12]} is not in the host tier")
        block = self.buffer[slot]
        if crc32(block) != expected:
            raise ValueError("checksum mismatch")
        if len(layers) != len(block) or layers[0].shape != block[0].shape:
            raise ValueError(f"a block of {tuple(block.shape)} does not fit this cache")
        for layer, dst in enumerate(layers):
            self.copies.copy(dst, block[layer])

    def discard(self, key: str) -> None:
        with self._lock:
            slot = self._slot.pop(key, None)
            self._crc.pop(key, None)
            if slot is not None:
                self._free.append(slot)


class LRUBlockIndex:
    """The scheduler side's record of which keys a bounded store holds, least recently used
    first. It decides evictions; the worker side's store follows its orders, step by step."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: str) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def add(self, key: str) -> list[str]:
        """Record `key` as most recently used; returns the keys evicted to make room."""
        evicted = []
        while len(self._keys) >= self.capacity_blocks:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return evicted

    def discard(self, key: str) -> bool:
        """Forget `key`; whether it was there."""
        if key not in self._keys:
            return False
        del self._keys[key]
        return True
