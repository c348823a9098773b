"""Linear layers over a GGUF file's own blocks (`quantization="gguf"`, opt-in).

A GGUF model loads as its dequantized fp32 weights, which is also what transformers computes
with. With `quantization="gguf"` the few-row kernel (`gguf_rows_linear`, kernels/csrc/gemv.cpp
over gguf_blocks.h) reads the file's Q4_0, Q4_1 and Q8_0 blocks in place of those weights:
SmolLM2's Q4_1 layers and Q8_0 head are 96 MB to stream per decode step, against 513 MB in
fp32. The kernel rebuilds each weight exactly as gguf's dequantizer does, so it computes the
same model as the GEMMs on the dequantized weights, and greedy output stays token-identical to
transformers on the file. Other types are dequantized at load, as without it.

A copy is attached only where its blocks dequantize to the weight the model holds, bit for
bit: after a weight update (RL) a changed weight loses its copy and runs unquantized.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from treadle.models.loader import gguf_tensors, unpermute_rope_rows

logger = logging.getLogger(__name__)

# ggml's type ids of the blocks the kernel reads (kernels/csrc/gguf_blocks.h), and each
# block's bytes (32 weights). The K-quants read so ran no faster than fp32 at one row
# (docs/performance-log.md), so they are dequantized at load like every other type.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}

# Rows up to which `gguf_rows_linear` serves. Past them decoding the blocks costs more than
# the fp32 panels' reads: SmolLM2's Q4_1 layers took 3.7-4.5, 4.8-6.3, 8.1-10.5 and 11.3-11.6
# ms at 1, 2, 4 and 6 rows, the panels 8.3-11.0, 8.1-10.7, 8.2-10.6 and 8.9-10.9 (docs/
# performance-log.md, "Lever: a GGUF file's own blocks").
GGUF_ROWS = 4


class GgufWeight:
    """A [out, in] weight as GGUF blocks of one ggml type: uint8 [out, in / 32 * block bytes]."""

    max_rows = GGUF_ROWS

    def __init__(self, blocks: torch.Tensor, ggml_type: int) -> None:
        if ggml_type not in BLOCK_BYTES:
            raise ValueError(f"ggml type {ggml_type} is not one of Q4_0, Q4_1, Q8_0")
        self.tensors = (blocks,)
        self.ggml_type = ggml_type

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.treadle.gguf_rows_linear(x, self.tensors[0], self.ggml_type, bias)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, as gguf's own dequantizer computes it."""
        # Imported here: the engine runs without gguf (a GPU machine may lack it) until a
        # GGUF file is read.
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        (blocks,) = self.tensors
        weight = dequantize(blocks.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(weight.reshape(blocks.shape[0], -1))


def read(model: nn.Module, path: str) -> dict[str, GgufWeight]:
    """The GGUF blocks of `model`'s weights in the file at `path`, by parameter name: the fused
    q/k/v and gate/up weights from their parts (where all share one ggml type), a tied head
    from the embedding. Weights of other stages or types are left out."""
    params = dict(model.named_parameters())
    parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for name, tensor, heads, _shift in gguf_tensors(path, model.config):
        ggml_type = int(tensor.tensor_type)
        if ggml_type not in BLOCK_BYTES or not name.endswith(".weight") or len(tensor.shape) != 2:
            continue
        if name == "model.embed_tokens.weight" and name not in params:
            name = "lm_head.weight"   # a last stage's copy of a tied embedding
        fused = model._fused_target(name)
        param, offset = (fused[0], fused[1]) if fused is not None else (name, 0)
        if param not in params:
            continue
        blocks = torch.from_numpy(np.array(tensor.data, copy=True))   # out of the file's map
        if heads is not None:
            blocks = unpermute_rope_rows(blocks, heads)
        parts.setdefault(param, []).append((offset, ggml_type, blocks))
    copies = {}
    for param, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        types = {t for _, t, _ in pieces}
        # Parts of other types (llama.cpp writes Mixtral's k and v in Q8_0 beside a Q4_0 q)
        # have blocks of other sizes, which cannot be joined; joined, a new contiguous tensor.
        blocks = torch.cat([b for _, _, b in pieces]) if len(types) == 1 else None
        if blocks is not None and blocks.shape[0] == params[param].shape[0]:
            copies[param] = GgufWeight(blocks, types.pop())
        else:
            logger.info("%s: its parts are not all of one GGUF type; it runs unquantized", param)
    return copies


def attach(model: nn.Module, copies: dict[str, GgufWeight]) -> dict[int, GgufWeight]:
    """The copies whose blocks are still exactly their weights, by the weight's id."""
    params = dict(model.named_parameters())
    kept = {id(params[n]): c for n, c in copies.items() if torch.equal(c.dequantize(), params[n].detach())}
    if len(kept) < len(copies):
        logger.warning("%d of %d weights no longer equal their GGUF blocks (a weight update?): "
                       "they run unquantized", len(copies) - len(kept), len(copies))
    return kept
