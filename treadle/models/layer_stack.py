"""A pipeline stage's layers in one C++ call per step.

`torch.classes.treadle.LayerStack` (treadle/kernels/csrc/layer_stack.cpp) runs a stage's
decoder layers with the kernels the Python layers call, chosen by the same rules
(`linear.linear`) and run in the same order, so the hidden states are the same bits; it only
removes the interpreter between ops: about a fifth of a batch-1 step, and as much again in a
step with prefill chunks (docs/performance-log.md). It serves every step whose attention runs in the
C++ kernels; the Python layers serve the rest (no kernels, or tensor parallelism).
"""

from __future__ import annotations

import torch

from treadle.attention.backend import AttentionMetadata
from treadle.attention.cpu_backend import CpuKernelMetadata
from treadle.models import linear
from treadle.models.gguf_weights import GgufWeight
from treadle.models.linear import Linear


def build(model: torch.nn.Module) -> torch.ScriptObject | None:
    """A stack over `model`'s layers on this stage, or None where it cannot serve: without
    the CPU kernels, with tensor parallelism (its row-parallel layers all-reduce), with
    mixture-of-experts layers (it knows only a dense MLP), with RoPE on part of each head, with
    soft-capped attention, or for a model whose layers are not Llama's (`stackable`: Gemma)."""
    if not model.native_head or model.ctx.tp_size > 1 or not getattr(model, "stackable", True):
        return None
    layers = [model.model.layers[i] for i in model.model.layer_range]
    if not all(hasattr(layer.mlp, "gate_up_proj") for layer in layers):
        return None
    if any(layer.self_attn.attn.logit_softcap is not None for layer in layers):
        return None
    if model.model.rotary.dim != layers[0].self_attn.head_dim:   # RoPE on part of each head
        return None
    attn = layers[0].self_attn
    tiles = attn.qkv_proj.tiles   # a stage's linears all have tiles of one kind, or none
    first, last = linear.tile_rows(tiles) if tiles is not None else (1, 0)
    stack = torch.classes.treadle.LayerStack(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                             layers[0].input_layernorm.eps, attn.attn.scale,
                                             linear.SMALL_ROWS, first, last)
    for layer in layers:
        a = layer.self_attn
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        a.q_norm.weight if a.q_norm is not None else None,
                        a.k_norm.weight if a.k_norm is not None else None)
        if a.attn.sliding_window is not None:
            stack.set_window(a.attn.sliding_window)
        for lin in (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            _add_linear(stack, lin)
    return stack


def _add_linear(stack: torch.ScriptObject, lin: Linear) -> None:
    copy = lin.quantized
    if copy is None:
        q, scales, ggml_type, rows = None, None, -1, 0
    elif isinstance(copy, GgufWeight):
        q, scales, ggml_type, rows = copy.tensors[0], None, copy.ggml_type, copy.max_rows
    else:
        (q, scales), ggml_type, rows = copy.tensors, -1, copy.max_rows
    stack.add_linear(lin.weight, lin.bias, q, scales, ggml_type, rows, lin.packed, lin.tiles, lin.bf16x3)


def serves(meta: AttentionMetadata) -> bool:
    """Whether the stack runs this step: its attention runs in the C++ kernels."""
    return isinstance(meta, CpuKernelMetadata)


def forward(stack: torch.ScriptObject, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: CpuKernelMetadata) -> torch.Tensor:
    decode, prefill = meta.decodes, meta.prefills
    decodes = (decode.block_table, decode.seq_lens) if decode else (None, None)
    chunks = (prefill.block_table, prefill.query_start, prefill.context_lens) if prefill else (None, None, None)
    return stack.forward(h, cos, sin, kv_caches, meta.slot_mapping, *decodes, *chunks)
