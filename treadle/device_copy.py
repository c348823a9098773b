"""Copies between the host and the device that never make the host wait for the GPU.

A step's inputs (token ids, positions, block tables, sampling parameters, row indices) go up
from host memory. From pageable memory a copy to a GPU waits for the stream to drain first: a
host sync in the middle of the step, where the GPU then idles while the host prepares the rest.
From pinned memory the copy is queued like a kernel and the host goes on (`to_device`). Even
indexing a CUDA tensor with a Python list is such a copy, so the step indexes with tensors made
here. The step's results come down once, its sampled tokens and logprobs, through pinned
memory and an event (`to_host`, or `HostCopy` where the wait comes later): the one sync of a
step (`sanctioned_sync`).

On a CPU every copy here is none: the host tensor is the device tensor.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a host tensor to copy to `device`: pinned for CUDA, whence a non-blocking copy
    does not wait for the GPU (from pageable memory it would)."""
    host = torch.from_numpy(array)
    return host.pin_memory() if device.type == "cuda" else host


def copy_padded(buffer: torch.Tensor, values: np.ndarray, size: int, pad: int) -> None:
    """buffer[:size] = values, then `pad` after them, in one copy from pinned memory (the
    padding made on the host, where a fill would be a launch of its own on the device)."""
    host = np.full(size, pad, dtype=np.int64 if buffer.dtype == torch.int64 else np.int32)
    host[:len(values)] = values
    buffer[:size].copy_(host_tensor(host, buffer.device), non_blocking=True)


def to_device(values: np.ndarray | Sequence, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (an array or a list, as `torch.as_tensor` takes them) on `device`, queued
    without a sync. On a CPU, an array's own memory (callers pass arrays they no longer write)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@contextmanager
def sanctioned_sync() -> Iterator[None]:
    """The step's one wait for the GPU, exempt from `torch.cuda.set_sync_debug_mode` (a GPU test
    runs steps with it set to "error" to prove that nothing else waits)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class HostCopy:
    """Device tensors on their way into pinned host memory: the copies and an event after them
    are queued when this is made, and `wait` waits for that event only. A deferred step makes
    one right after its sampling, before the next step is queued: made at its wait instead, the
    copies would queue behind the next step's whole forward pass, and the host would wait for
    that too (async scheduling on the H200 was slower than without, until this)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._done: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._hosts = list(tensors)
            return
        self._hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self._hosts, tensors):
            host.copy_(t, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once their copies are done."""
        if self._done is not None:
            with sanctioned_sync():
                self._done.synchronize()
        return self._hosts


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors as host tensors: on CUDA, non-blocking copies into pinned memory and one
    wait, on an event recorded after them."""
    return HostCopy(tensors).wait()
