"""Linear layers whose weights are packed once for oneDNN on CPU, packed for the tile kernel
(AMX tiles in bf16 where the CPU has them, AVX-512 panels in fp32, and in fp32 past the panels'
rows AMX tiles over three bf16 parts of each value), and optionally given a weight-only copy
for the few-row kernels: int8 (`Int8Weight`) or a GGUF file's own blocks
(models/gguf_weights.py).

`F.linear` on CPU calls MKL's sgemm, which re-packs the weight matrix on every call. At decode
batch sizes that packing costs about as much as the multiply. A weight packed once into
oneDNN's blocked layout measured, for SmolLM2's 30 layers on 2 cores (fp32), 2.1x faster at 37
rows and 1.16x at 2,048 rows (docs/performance-log.md).

The packed copy lives beside the weight, which stays the source of truth for loading and RL
weight updates. The packed copy is a snapshot, so it must be packed again after any change
to the weights (the model's `load_weights` does this), and unpacked before they are
discarded. Packing costs one extra copy of each packed weight in memory.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treadle.kernels.cpu import cpu_has

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
# at these sizes a layer is bound by reading its weight. SmolLM2's linears, 2 cores, ms per
# pass at 1/2/3/4 rows: fp32 16.9/16.9/18.7/20.4 against 24.1/26.6/23.0/21.3, bf16
# 8.9/9.5/10.6/13.1 against 14.4/15.2/13.1/12.9 (docs/performance-log.md).
SMALL_ROWS = 4


def _small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.treadle.small_rows_linear(x, weight, bias)


# Rows up to which `int8_rows_linear` beats the packed fp32 GEMM: 5.5/11.9/16.0 ms against
# 21.1/17.2/17.3 at 1/4/6 rows, level at 8 (docs/performance-log.md).
INT8_ROWS = 6
INT8_GROUP = 32   # weights per scale, along the input dimension (as GGUF's Q8_0)


# Rows from which and up to which the AMX tile kernel `tiles_linear` (bf16) serves: in a
# SmolLM2 decode step it beat the few-row kernel from 3 rows (level at 2), and its GEMMs beat
# oneDNN's packed ones by 20-23% per layer from 288 to 1,024 rows, but not at 2,048 (bf16
# TTFT at 512 tokens 111 -> 90-100 ms; docs/performance-log.md).
TILE_FROM_ROWS = 2
TILE_ROWS = 1024
# In fp32 the same copy holds AVX-512 panels (kernels/csrc/linear_panels.cpp), up to this many
# rows. On the Xeon with AMX a SmolLM2 layer's four linears took 0.28-0.34 ms against oneDNN's
# 0.55-0.61 at 2-8 rows, 1.15 against 1.67 at 48, 2.97 against 3.11 at 128, but 5.95 against
# 5.55 at 256, and past 128 rows the bf16x3 kernel (below) takes them there. Without AMX the
# panels held their lead further: 1.10x oneDNN's speed at 128 rows, 1.04-1.07x at 192-320,
# 1.03x at 384, level from 448 (weights from memory, Zen 5; docs/performance-log.md).
PANEL_ROWS = 128 if cpu_has("amx_tile") else 384
# In bf16 on a CPU with AVX512-BF16 but no AMX tiles, the same copy holds panels of bf16 pairs
# (kernels/csrc/linear_pairs.cpp), from 1 row up to PAIR_ROWS: a SmolLM2 layer's four linears,
# weights from memory, took 134 µs against the few-row kernel's 148 at 1 row, 147 against
# oneDNN's 242 at 8, 298 against 443 at 32, 980 against 1,156 at 128 and 3,813 against 3,897
# at 512; level with oneDNN from 768 to 1,024 rows (Zen 5, docs/performance-log.md).
PAIR_ROWS = 512
# Past PANEL_ROWS an fp32 weight with AMX tiles runs `bf16x3_linear` (kernels/csrc/
# linear_bf16x3.cpp): each operand split into three bf16 parts, six of their products summed in
# fp32, as precise as an fp32 GEMM. It has no upper limit of rows, so such a weight needs no
# oneDNN copy.


def tile_rows(tiles: torch.Tensor) -> tuple[int, int]:
    """The first and the last row count the tile kernel serves over `tiles` (pack_tiles'
    copy): AVX-512 panels in fp32; in bf16 AMX tiles (a 4-D copy) or, without AMX, panels of
    pairs (3-D)."""
    if tiles.dtype == torch.float32:
        return TILE_FROM_ROWS, PANEL_ROWS
    return (TILE_FROM_ROWS, TILE_ROWS) if tiles.dim() == 4 else (1, PAIR_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None, native: bool = False,
           quantized: QuantizedWeight | None = None,
           tiles: torch.Tensor | None = None, bf16x3: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias where `native`: the weight-only copy up to its `max_rows` where
    there is one, the tile kernel over the rows tile_rows() gives where the weight has tiles,
    the bf16x3 kernel past that where the weight has its parts, the few-row kernel up to
    SMALL_ROWS; else the packed GEMM where there is a packed weight, else torch's. The layer
    stack (kernels/csrc/layer_stack.cpp) chooses by the same rules."""
    rows = x.shape[0]
    if native and quantized is not None and rows <= quantized.max_rows:
        return quantized.linear(x, bias)
    if native and tiles is not None:
        first, last = tile_rows(tiles)
        if first <= rows <= last:
            return torch.ops.treadle.tiles_linear(x, tiles, bias)
    if native and bf16x3 is not None and rows > PANEL_ROWS:
        return torch.ops.treadle.bf16x3_linear(x, bf16x3, bias)
    if native and rows <= SMALL_ROWS:
        return _small_rows_linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    padded = gemm_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


@torch.inference_mode()
def warm_up_gemms(model: nn.Module, max_rows: int, head_rows: int) -> int:
    """Run every packed `Linear`'s GEMM once at each row count `gemm_rows` gives up to
    `max_rows` (a step's most tokens), so that no step pays for oneDNN's JIT; returns how many
    GEMMs ran. Weights of one shape share their kernels, so one of each shape is enough. The
    GEMM alone: a row-parallel layer's all-reduce has nothing to warm up. (A tied head's packed
    copy is not a `Linear` and is not warmed: its rows are a step's sequences, a few counts.)

    The model's own head (`lm_head`, untied) only up to `head_rows`, the rows a step samples:
    its rows are the vocabulary (49,152 for SmolLM2's tokenizer), and warming it up to 2,048
    rows took 20 s of a tiny model's 21 s start-up on a Zen 3. Only a step's prompt logprobs
    score more rows; each count past `head_rows` pays the JIT once, in that step."""
    head = getattr(model, "lm_head", None)
    by_shape: dict[tuple, Linear] = {}
    limits: dict[tuple, int] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None:
            key = (tuple(module.weight.shape), module.bias is not None)
            by_shape.setdefault(key, module)
            limits[key] = max(limits.get(key, 0), head_rows if module is head else max_rows)
    ran = 0
    for key, module in by_shape.items():
        # the tile kernel serves its rows: no GEMM for them to warm up
        first = tile_rows(module.tiles)[1] + 1 if module.tiles is not None else SMALL_ROWS + 1
        for rows in sorted({gemm_rows(r) for r in range(first, limits[key] + 1)}):
            linear(module.weight.new_zeros(rows, module.in_features), module.weight, module.bias, module.packed)
            ran += 1
    return ran


def gemm_rows(rows: int) -> int:
    """The rows a packed GEMM of `rows` rows runs with: rounded up to 1/16 of their power of
    two, and to a multiple of 8 (at most 7 more rows, or 6% more), so that oneDNN JIT-compiles
    kernels for 80 row counts up to 2,048 rather than for every one. A new count cost about 5 ms
    for SmolLM2's four linears, paid by the step whose token count it is, and every prompt of a
    new length was one (vLLM builds its oneDNN matmuls with a runtime row count instead). Each
    output row depends on its input row only, so the zero rows added change nothing else.
    The layer stack (kernels/csrc/layer_stack.cpp) pads the same way; a test holds the two equal."""
    step = max(8, 1 << max(0, rows.bit_length() - 5))
    return -(-rows // step) * step


class Linear(nn.Linear):
    """nn.Linear that uses its packed weight when it has one, and the C++ kernel for a few
    rows once `native` is set (models' use_cpu_kernels). Inputs are [tokens, in]."""

    packed: torch.Tensor | None = None
    native = False
    quantized: QuantizedWeight | None = None   # a weight-only copy for a few rows
    tiles: torch.Tensor | None = None   # AMX tiles (bf16) or AVX-512 panels (fp32), once `native`
    bf16x3: torch.Tensor | None = None   # fp32's three bf16 parts as AMX tiles, once `native`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.native, self.quantized, self.tiles,
                      self.bf16x3)


class QuantizedWeight(Protocol):
    """A weight-only copy of a weight that the few-row kernels read in its place, up to
    `max_rows` rows. It computes the model its `dequantize()` gives, which the weight itself
    holds, so the GEMMs past those rows compute the same model. `tensors` are what a decode
    step reads (kernels/hugepages.py may move them)."""

    tensors: tuple[torch.Tensor, ...]
    max_rows: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def dequantize(self) -> torch.Tensor: ...


class Int8Weight:
    """Weight-only int8 for a [out, in] weight: q (int8) and one fp32 scale per INT8_GROUP
    inputs, the largest magnitude of the group over 127.

    `quantize` also overwrites the weight with q * scale, so the GEMM (prefill, large batches)
    and the int8 kernel (a few rows) compute one model, which transformers can load as it
    is. A weight that still equals its previous quantization keeps it: quantizing q * scale
    again could move a scale by an ulp, and with it the model."""

    max_rows = INT8_ROWS

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.tensors = (q, scales)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.treadle.int8_rows_linear(x, *self.tensors, bias)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return weight.dim() == 2 and weight.shape[1] % INT8_GROUP == 0 and weight.dtype == torch.float32

    def dequantize(self) -> torch.Tensor:
        q, scales = self.tensors
        return (q.float().view(q.shape[0], -1, INT8_GROUP) * scales[..., None]).view_as(q)

    @classmethod
    @torch.no_grad()
    def quantize(cls, weight: torch.Tensor, previous: Int8Weight | None = None) -> Int8Weight:
        if previous is not None and torch.equal(weight, previous.dequantize()):
            return previous
        groups = weight.view(weight.shape[0], -1, INT8_GROUP)
        scales = groups.abs().amax(-1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))   # an all-zero group
        q = torch.round(groups / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        quantized = cls(q.view_as(weight).contiguous(), scales.contiguous())
        weight.copy_(quantized.dequantize())
        return quantized


def quantize_weights(model: nn.Module) -> int:
    """Weight-only int8 for every `Linear` whose weight allows it; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and Int8Weight.supports(module.weight):
            previous = module.quantized if isinstance(module.quantized, Int8Weight) else None
            module.quantized = Int8Weight.quantize(module.weight, previous)
            count += 1
    return count


def pack_weights(model: nn.Module, device: torch.device) -> int:
    """(Re)pack every `Linear` of `model` for oneDNN, but for those whose bf16x3 parts will
    serve every row count past the tile kernel's; returns how many were packed."""
    if not packing_supported(device):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            takes_bf16x3 = module.native and torch.ops.treadle.linear_bf16x3_ready(module.weight)
            module.packed = None if takes_bf16x3 else pack(module.weight)
            count += module.packed is not None
    return count


def pack_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as the tile kernel's AMX tiles or, without them, panels of pairs (bf16), or
    AVX-512 panels (fp32); None where the CPU, the process, the dtype or the shape does not
    allow them."""
    if not torch.ops.treadle.linear_tiles_ready(weight):
        return None
    return torch.ops.treadle.pack_linear_tiles(weight.detach())


def pack_weight_tiles(model: nn.Module) -> int:
    """(Re)pack the tiles, and in fp32 the bf16x3 parts, of every `Linear` that runs the C++
    kernels; returns how many have tiles."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.native:
            module.tiles = pack_tiles(module.weight)
            module.bf16x3 = (torch.ops.treadle.pack_linear_bf16x3(module.weight.detach())
                             if torch.ops.treadle.linear_bf16x3_ready(module.weight) else None)
            count += module.tiles is not None
    return count


def unpack_weights(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = None
            module.quantized = None
            module.tiles = None
            module.bf16x3 = None
