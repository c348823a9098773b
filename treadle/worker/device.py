"""What a worker does differently on each kind of device, in one place: where the memory for
weights and the KV cache comes from, whether the C++ kernels serve the model, and what sleep
moves or frees. The model runner asks its `WorkerDevice`, never `device.type`."""

from __future__ import annotations

import torch

from treadle.kernels import hugepages
from treadle.kernels.cpu import cpu_kernels_available
from treadle.worker.malloc import keep_freed_memory, return_freed_memory

TensorSpec = tuple[tuple[int, ...], torch.dtype]


class WorkerDevice:
    """A device without special memory: plain allocations, no kernels of treadle's own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Whether the C++ kernels (treadle/kernels) serve the model's GEMMs, norms and attention.
        self.native_kernels = False
        # Whether decode steps can be captured as CUDA graphs (worker/cuda_graphs.py).
        self.captures_graphs = False
        # Whether sleep(level=1) moves the weights to host memory.
        self.offloads_weights = True

    def empty(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Uninitialised memory for each (shape, dtype): the parameters, before a load fills them."""
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]

    def zeros(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Zeroed memory for each (shape, dtype): the KV cache, one tensor per layer."""
        return [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in specs]

    def offload(self, model: torch.nn.Module) -> None:
        """sleep(level=1): the weights leave the device for host memory."""
        model.to("cpu")

    def reload(self, model: torch.nn.Module) -> None:
        """wake_up: the weights come back."""
        model.to(self.device)

    def release_cached_memory(self) -> None:
        """Give memory freed by start-up or sleep back to the device (and so to other
        processes)."""


class CpuDevice(WorkerDevice):
    """The host: weights and bf16 K/V in huge pages, the C++ kernels where they are built, and
    a heap that keeps freed memory (activations come from it, not the kernel, every layer)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        keep_freed_memory()
        self.native_kernels = cpu_kernels_available(device)
        self.offloads_weights = False   # they are in host memory already

    def empty(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        # Side by side in huge pages (kernels/hugepages.py): decode streams the weights at a
        # few rows, and a tied head's at every step.
        return hugepages.carve(specs)

    def zeros(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        # Zeroed up front, as vLLM does: the torch path reads whole blocks and masks the slots
        # past a sequence's end, which must then be finite (0 * NaN = NaN); and a page touched
        # now is not page-faulted in a step. Left to the first write, a 288-token fp32 prompt
        # paid 13 ms of faults on a fresh server, and memory a VM had never backed cost up to
        # 2.6 s/GB there (docs/performance-log.md). Start-up pays about 0.25 s/GB instead.
        if all(dtype == torch.bfloat16 for _, dtype in specs):
            # bf16 K/V in huge pages: decode attention read it 25-40% faster in the engine.
            # fp32 stays in 4 KiB pages: its attention alone read them only 4% faster there,
            # and no step or offline run gained (docs/performance-log.md, "huge pages, again").
            return [t.zero_() for t in hugepages.carve(specs)]
        return super().zeros(specs)

    def offload(self, model: torch.nn.Module) -> None:
        """Nothing to do: the weights are in host memory already."""

    def reload(self, model: torch.nn.Module) -> None:
        """Nothing to do: the weights never left."""

    def release_cached_memory(self) -> None:
        return_freed_memory()


class CudaDevice(WorkerDevice):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.captures_graphs = True

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()


def worker_device(device: torch.device) -> WorkerDevice:
    """The WorkerDevice for `device`."""
    if device.type == "cpu":
        return CpuDevice(device)
    if device.type == "cuda":
        return CudaDevice(device)
    return WorkerDevice(device)
