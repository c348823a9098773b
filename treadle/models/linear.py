"""Linear layers whose weights are packed once for oneDNN on CPU.

`F.linear` on CPU calls MKL's sgemm, which re-packs the weight matrix on every call. At decode
batch sizes that packing costs about as much as the multiply. A weight packed once into
oneDNN's blocked layout measured, for SmolLM2's 30 layers on 2 cores (fp32), 2.1x faster at 37
rows and 1.16x at 2,048 rows (docs/benchmarks.md).

The packed copy lives beside the weight, which stays the source of truth for loading and RL
weight updates. The packed copy is a snapshot, so it must be packed again after any change
to the weights (the model's `load_weights` does this), and unpacked before they are
discarded. Packing costs one extra copy of each packed weight in memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def packing_supported(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where oneDNN can't take its dtype."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError as exc:
        logger.debug("not packing a %s weight: %s", weight.dtype, exc)
        return None


# Rows up to which the C++ kernel `small_rows_linear` (treadle/kernels) beats the packed GEMM:
# at these sizes a layer is bound by reading its weight (docs/benchmarks.md).
SMALL_ROWS = 2


def _small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.treadle.small_rows_linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None, native: bool = False) -> torch.Tensor:
    """x @ weight.T + bias: the C++ kernel at a few rows where `native`, else the packed GEMM
    where there is a packed weight, else torch's."""
    if native and x.shape[0] <= SMALL_ROWS:
        return _small_rows_linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that uses its packed weight when it has one, and the C++ kernel for a few
    rows once `native` is set (models' use_cpu_kernels). Inputs are [tokens, in]."""

    packed: torch.Tensor | None = None
    native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.native)


def pack_weights(model: nn.Module, device: torch.device) -> int:
    """(Re)pack every `Linear` of `model`; returns how many were packed."""
    if not packing_supported(device):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = pack(module.weight)
            count += module.packed is not None
    return count


def unpack_weights(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = None
