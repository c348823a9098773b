"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a flat batch of tokens and a paged
KV cache.

Qwen2 is Llama with biases on q/k/v; Qwen3 is Llama with an RMSNorm on each q and k head;
Mistral (and Qwen2 with use_sliding_window) has layers that attend within a sliding window.
Numerics follow transformers' implementation op for op (RMSNorm in fp32, RoPE tables in fp32,
rotate-half), so greedy output in fp32 matches it token for token.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from treadle.attention.backend import AttentionMetadata, PagedAttention
from treadle.config import layer_window
from treadle.distributed.parallel_state import ParallelContext
from treadle.kernels import hugepages
from treadle.models import gguf_weights, layer_stack, linear
from treadle.models.linear import Linear
from treadle.models.parallel import MissingLayer, WeightSharder, embedding, row_linear
from treadle.models.rope import RotaryEmbedding, apply_rope

logger = logging.getLogger(__name__)

# A transformers name of one part of a fused weight: (owner module, part, weight or bias).
_FUSED_PART = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class RMSNorm(nn.Module):
    native = False   # the fused C++ op (treadle/kernels), set by use_cpu_kernels
    use_triton = False   # the Triton kernels (models/triton_ops.py), set by use_triton_ops

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from treadle.models import triton_ops
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if self.native:
            return torch.ops.treadle.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): the residual add before a norm, in one pass natively."""
        if self.use_triton:   # in place: x and residual are the layer's own, not used after
            from treadle.models import triton_ops
            x, h = triton_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return h, x
        if self.native:
            return torch.ops.treadle.add_rms_norm(x, residual, self.weight, self.eps)
        h = x + residual
        return h, self.forward(h)


class Attention(nn.Module):
    native = False   # RoPE in place by the fused C++ op
    use_triton = False   # RoPE on q and k in place by one Triton kernel
    # o_proj at a few rows by the Triton product (models/triton_gemv.py): 3.0 against cuBLAS's
    # 12.3 us for Qwen3-0.6B's at one row in a CUDA graph on an H200. Set by use_triton_ops.
    few_row_o_proj = False

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 ctx: ParallelContext, sliding_window: int | None = None) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        # This rank's heads (all of them with one rank); KV heads are replicated when fewer.
        self.num_heads = total_heads // ctx.tp_size
        self.num_kv_heads = max(1, total_kv_heads // ctx.tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # One fused GEMM for q, k and v.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = row_linear(self.q_size, config.hidden_size, o_bias, ctx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   sliding_window)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), cos, sin, kv_cache, meta)

    def attend(self, qkv, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's attention from its fused q/k/v projection [tokens, q + 2 kv]."""
        t = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.use_triton:
            from treadle.models import triton_ops
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            # Where the backend lets it, the RoPE kernel writes K/V into the cache as it makes
            # K, and the backend's own write launch is saved (heads rotated whole only).
            target = (self.attn.kv_target(kv_cache, meta) if cos.shape[-1] == self.head_dim
                      else None)
            write_kv = (v, target) if target is not None else None
            if self.q_norm is None:
                triton_ops.rope_(q, k, cos, sin, write_kv)
            elif (type(self.q_norm) is type(self.k_norm) is RMSNorm
                  and q.dtype == self.q_norm.weight.dtype == self.k_norm.weight.dtype
                  and self.q_norm.eps == self.k_norm.eps
                  and triton_ops.fuses_qk_norm_rope(self.head_dim, cos.shape[-1])):
                q, k = triton_ops.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight,
                                               self.q_norm.eps, cos, sin, write_kv)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
                triton_ops.rope_(q, k, cos, sin, write_kv)
            if write_kv is not None:
                return self._o_proj(self.attn.attend_written(q, kv_cache, meta))
            return self._o_proj(self.attn(q, k, v, kv_cache, meta))
        # The fused op rotates whole heads: a partly rotary head takes the Python path.
        rope = self._rope_in_place if self.native and cos.shape[-1] == self.head_dim else apply_rope
        if self.q_norm is None:
            # q and k sit side by side in the fused output: one RoPE pass over both heads.
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = rope(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def _o_proj(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_row_o_proj:
            from treadle.models import triton_gemv
            if triton_gemv.serves(x.shape[0], self.o_proj.weight):
                return triton_gemv.gemv(x, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(x)

    @staticmethod
    def _rope_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        torch.ops.treadle.rope_(x, cos, sin)
        return x


class MLP(nn.Module):
    native = False   # SiLU-and-mul by the fused C++ op
    use_triton = False   # SiLU-and-mul by a Triton kernel

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ctx: ParallelContext,
                 reduce: bool = True) -> None:
        """`intermediate_size` is the whole model's: a rank holds its share. With reduce=False
        the down projection's partial sums are left for the caller to all-reduce (experts of a
        mixture-of-experts block, summed before one all-reduce)."""
        super().__init__()
        self.intermediate = intermediate_size // ctx.tp_size
        self.gate_up_proj = Linear(hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = (row_linear(self.intermediate, hidden_size, bias, ctx) if reduce
                          else Linear(self.intermediate, hidden_size, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from treadle.models import triton_ops
            return self.down_proj(triton_ops.silu_and_mul(self.gate_up_proj(x)))
        if self.native:
            return self.down_proj(torch.ops.treadle.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


def dense_mlp(config, index: int, ctx: ParallelContext) -> nn.Module:
    """A Llama layer's feed-forward block (every layer has the same)."""
    return MLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False), ctx)


class DecoderLayer(nn.Module):
    # Each norm in the launch of the projection after it, and SiLU-and-mul in the down
    # projection's, at a few rows (models/triton_gemv.py): set by use_triton_ops where the
    # layer's parts are the plain ones those launches stand for.
    few_row_linears = False

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp: nn.Module,
                 ctx: ParallelContext, sliding_window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qkv_bias, o_bias, qk_norm, ctx, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """(x, residual) -> (this layer's output, the residual stream before it is added):
        as in vLLM, each residual add happens in the norm after it (add_and_norm). The first
        layer takes the embeddings as x with no residual."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            if self.few_row_linears:
                from treadle.models import triton_gemv
                if triton_gemv.serves(x.shape[0], self.self_attn.qkv_proj.weight):
                    return self._few_rows(x, residual, cos, sin, kv_cache, meta)
            residual, x = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        residual, x = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual

    def _few_rows(self, x, residual, cos, sin, kv_cache, meta):
        """forward's arithmetic in three launches fewer (few_row_linears)."""
        from treadle.models import triton_gemv
        attn, mlp = self.self_attn, self.mlp
        norm, qkv_proj = self.input_layernorm, attn.qkv_proj
        qkv, residual = triton_gemv.add_norm_gemv(x, residual, norm.weight, norm.eps,
                                                  qkv_proj.weight, qkv_proj.bias)
        x = attn.attend(qkv, cos, sin, kv_cache, meta)
        norm, gate_up_proj, down_proj = self.post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj
        gate_up, residual = triton_gemv.add_norm_gemv(x, residual, norm.weight, norm.eps,
                                                      gate_up_proj.weight, gate_up_proj.bias)
        return triton_gemv.silu_mul_gemv(gate_up, down_proj.weight, down_proj.bias), residual

    def takes_few_row_linears(self) -> bool:
        """Whether the fused launches compute this layer: Llama's norms, and a dense MLP with
        no all-reduce after its down projection. (They read each Linear's `weight`, which holds
        the model a weight-only quantized copy computes.)"""
        linears = (self.self_attn.qkv_proj, getattr(self.mlp, "gate_up_proj", None),
                   getattr(self.mlp, "down_proj", None))
        return (type(self.input_layernorm) is type(self.post_attention_layernorm) is RMSNorm
                and type(self.mlp) is MLP and all(type(lin) is Linear for lin in linears))


class DecoderModel(nn.Module):
    """A pipeline stage holds only its layers; the first stage embeds, the last normalises."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, max_positions: int,
                 make_mlp: Callable[[object, int, ParallelContext], nn.Module],
                 ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_range = ctx.layer_range(config.num_hidden_layers)
        self.embed_tokens = (embedding(config.vocab_size, config.hidden_size, ctx)
                             if ctx.is_first_stage else None)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, qk_norm, make_mlp(config, i, ctx), ctx,
                         layer_window(config, i))
            if i in self.layer_range else MissingLayer() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if ctx.is_last_stage else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror transformers' (`model.layers.N...`), except the fused projections."""

    qk_norm = False
    make_mlp = staticmethod(dense_mlp)   # (config, layer index, ctx) -> the layer's feed-forward
    # Its forward reads nothing back to the host: worker/cuda_graphs.py may capture a decode step.
    capturable = True
    is_packed = False    # pack_weights has run (a no-op off CPU): weight loads re-pack
    # "int8" or "gguf" (the file's blocks, from gguf_file): weight-only copies for a few rows,
    # set before pack_weights
    quantization: str | None = None
    gguf_file: str | None = None

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config, max_positions: int, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx = ctx or ParallelContext()
        self.model = self.build_model(config, max_positions, ctx)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self._packed_head: torch.Tensor | None = None
        self._tiles_head: torch.Tensor | None = None   # the head for the tile kernel, once native
        # The head's weight-only copy; on a first stage of several with a tied head, the
        # embedding's
        self._quantized_head: linear.QuantizedWeight | None = None
        self._gguf_blocks: dict[str, gguf_weights.GgufWeight] | None = None   # read once
        self.native_head = False   # the head through the C++ kernel at a few rows
        # This stage's layers in one C++ call per step (models/layer_stack.py); built with the
        # packed weights once the CPU kernels serve the model.
        self.layer_stack: torch.ScriptObject | None = None
        # A tied head is the embedding, unless the embedding lives on another stage: then the
        # last stage loads its own copy of it.
        tied_head_here = self.tie_word_embeddings and ctx.is_last_stage and not ctx.is_first_stage
        if (self.tie_word_embeddings and not tied_head_here) or not ctx.is_last_stage:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size // ctx.tp_size, bias=False)
        self.sharder = WeightSharder(config, ctx, self.model.rotary.head_dim, tied_head_here)

    def build_model(self, config, max_positions: int, ctx: ParallelContext) -> nn.Module:
        """This stage's decoder: the checkpoint's `model.*`."""
        qkv_bias, o_bias = self.biases(config)
        return DecoderModel(config, qkv_bias, o_bias, self.qk_norm, max_positions, self.make_mlp, ctx)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch [T] -> this stage's output [T, hidden]: the final hidden states on the
        last stage, else what the next stage takes (`hidden` is the previous stage's)."""
        h = self.model.embed_tokens(input_ids) if self.ctx.is_first_stage else hidden
        cos, sin = self.model.rotary(positions, h.dtype)
        if self.layer_stack is not None and layer_stack.serves(meta):
            h = layer_stack.forward(self.layer_stack, h, cos, sin, kv_caches, meta)
        else:
            first, residual = self.model.layer_range.start, None
            for i in self.model.layer_range:
                h, residual = self.model.layers[i](h, residual, cos, sin, kv_caches[i - first], meta)
            if residual is not None:
                if self.ctx.is_last_stage:
                    return self.model.norm.add_and_norm(h, residual)[1]
                h = h + residual
        return self.model.norm(h) if self.ctx.is_last_stage else h

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def quantized_copies(self) -> dict[int, linear.QuantizedWeight]:
        """The weight-only copy that decode reads in place of a weight, by the weight's id:
        every quantized Linear's, and a tied head's (the embedding table's)."""
        copies = {id(m.weight): m.quantized for m in self.modules()
                  if isinstance(m, linear.Linear) and m.quantized is not None}
        if self._quantized_head is not None:
            copies[id(self._head_weight())] = self._quantized_head
        return copies

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler widens them to fp32 only for the rows that
        need more than their argmax."""
        logits = linear.linear(hidden, self._head_weight(), None, self._packed_head, self.native_head,
                               self._quantized_head, self._tiles_head)
        return self.ctx.all_gather_last_dim(logits)

    def pack_weights(self) -> None:
        """Pack the GEMM weights for the device's fastest kernel (see models/linear.py), after
        quantizing them if `quantization` is set. `load_weights` packs again by itself once
        the model is packed."""
        device = next(self.parameters()).device
        embed = self.model.embed_tokens
        tied_embed = self.lm_head is None and self.tie_word_embeddings and embed is not None
        if self.quantization == "int8":
            linear.quantize_weights(self)   # every Linear, a head of its own among them
            if tied_embed:
                # The head is the embedding; or, on the first of several stages, the embedding
                # must hold the same values as the last stage's tied head.
                previous = self._quantized_head if isinstance(self._quantized_head, linear.Int8Weight) else None
                self._quantized_head = linear.Int8Weight.quantize(embed.weight, previous)
        elif self.quantization == "gguf":
            self._attach_gguf(tied_embed)
        linear.pack_weights(self, device)
        self._packed_head = None
        if self.lm_head is not None:   # a Linear: packed and quantized above, not a second time
            self._packed_head, self._quantized_head = self.lm_head.packed, self.lm_head.quantized
        elif linear.packing_supported(device) and self.ctx.is_last_stage:   # only it scores
            self._packed_head = linear.pack(self._head_weight())
        self.is_packed = True
        self._pack_tiles()
        if device.type == "cpu":
            self._place_copies()
        self.layer_stack = layer_stack.build(self)   # over the new copies

    def _attach_gguf(self, tied_embed: bool) -> None:
        """The GGUF file's blocks for every weight they still equal (models/gguf_weights.py)."""
        if self._gguf_blocks is None:
            if self.gguf_file is None:
                raise ValueError("quantization='gguf' needs the model's GGUF file")
            self._gguf_blocks = gguf_weights.read(self, self.gguf_file)
        kept = gguf_weights.attach(self, self._gguf_blocks)
        for m in self.modules():
            if isinstance(m, linear.Linear):
                m.quantized = kept.get(id(m.weight))
        # Only the last stage scores: a first stage's tied embedding needs no copy.
        scores = tied_embed and self.ctx.is_last_stage
        self._quantized_head = kept.get(id(self.model.embed_tokens.weight)) if scores else None

    def _pack_tiles(self) -> None:
        """The tile kernel's copies of the weights the C++ kernels read: AMX tiles in bf16 where
        the CPU has them, AVX-512 panels in fp32."""
        if not self.native_head:
            return
        linear.pack_weight_tiles(self)
        self._tiles_head = None
        if self.lm_head is not None:
            self._tiles_head = self.lm_head.tiles
        elif self.ctx.is_last_stage:
            self._tiles_head = linear.pack_tiles(self._head_weight())

    def _place_copies(self) -> None:
        """The tile and weight-only copies that decode streams, side by side in huge pages
        (kernels/hugepages.py). oneDNN's packed copies live in its own memory."""
        linears = [m for m in self.modules() if isinstance(m, linear.Linear)]
        copies = {id(w): w for w in [m.quantized for m in linears] + [self._quantized_head] if w is not None}
        tensors = [m.tiles for m in linears] + [self._tiles_head]
        tensors += [t for w in copies.values() for t in w.tensors]
        placed = iter(hugepages.gather(tensors))
        for m in linears:
            m.tiles = next(placed)
        self._tiles_head = next(placed)
        for w in copies.values():
            w.tensors = tuple(next(placed) for _ in w.tensors)

    def use_cpu_kernels(self) -> None:
        """Run RMSNorm, RoPE, SiLU-and-mul and the linear layers at decode sizes through the C++
        kernels (treadle/kernels/cpu.py), which the caller has loaded; packs again if packed."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, linear.Linear)):
                module.native = True
        self.native_head = True
        if self.is_packed:
            self.pack_weights()

    def use_triton_ops(self, few_row_linears: bool = False) -> None:
        """Run the norms, the residual adds, RoPE and the activation through the Triton kernels
        (models/triton_ops.py): the path of attention_backend 'triton'. With few_row_linears,
        the layers that can take them fuse those ops into their projections at a few rows
        (models/triton_gemv.py)."""
        for module in self.modules():
            if hasattr(module, "use_triton"):
                module.use_triton = True
            if isinstance(module, DecoderLayer):
                module.few_row_linears = few_row_linears and module.takes_few_row_linears()
                # Not a tensor-parallel o_proj: its all-reduce is its own.
                module.self_attn.few_row_o_proj = (module.few_row_linears
                                                   and type(module.self_attn.o_proj) is Linear)

    def unpack_weights(self) -> None:
        linear.unpack_weights(self)
        self._packed_head = None
        self._quantized_head = None
        self._tiles_head = None
        self.layer_stack = None
        self.is_packed = False

    # -- weights ------------------------------------------------------------------
    def _fused_target(self, name: str) -> tuple[str, int, int] | None:
        """Map a transformers q/k/v or gate/up name to (fused param name, row offset, rows), by
        the module that holds the fused weight (a layer's attention, its MLP, or an expert);
        None for any other name, or where no such module is here (another stage's layer)."""
        match = _FUSED_PART.match(name)
        if match is None:
            return None
        owner_path, part, kind = match.groups()
        try:
            owner = self.get_submodule(owner_path)
        except AttributeError:
            return None
        if part in ("q_proj", "k_proj", "v_proj"):
            if not isinstance(owner, Attention):
                return None
            offset, rows = {"q_proj": (0, owner.q_size), "k_proj": (owner.q_size, owner.kv_size),
                            "v_proj": (owner.q_size + owner.kv_size, owner.kv_size)}[part]
            return f"{owner_path}.qkv_proj.{kind}", offset, rows
        if not isinstance(owner, MLP):
            return None
        offset = 0 if part == "gate_proj" else owner.intermediate
        return f"{owner_path}.gate_up_proj.{kind}", offset, owner.intermediate

    def _fused_offsets(self, name: str) -> list[int] | None:
        """The row offsets of the parts a fused parameter is loaded from, or None if unfused."""
        owner_path, _, leaf = name.rpartition(".")
        owner_path, _, param = owner_path.rpartition(".")
        if param == "qkv_proj":
            attn = self.get_submodule(owner_path)
            return [0, attn.q_size, attn.q_size + attn.kv_size]
        if param == "gate_up_proj":
            return [0, self.get_submodule(owner_path).intermediate]
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True,
                     before_copy: Callable[[], None] | None = None,
                     local: bool = False) -> set[str]:
        """Copy transformers-named tensors into this model; returns the names consumed.

        With strict=True every parameter must be covered (a full checkpoint); a partial
        update (RL weight sync) passes strict=False. Every name and shape is checked before
        anything is copied, so a refused update leaves the model as it was; `before_copy` is
        called once that check has passed. A packed model re-packs afterwards, so code that
        loads weights this way (e.g. via collective_rpc) needs no extra step; code that edits
        parameters in place must call pack_weights(). With local=True, `weights` are what
        local_weights made of them: this rank's parts, already cut.
        """
        plan, loaded = self._plan(weights, strict, local)
        if before_copy is not None:
            before_copy()
        for target, tensor in plan:
            target.copy_(tensor.to(target.dtype))
        if self.is_packed:    # a weight update: the packed copies must follow
            self.pack_weights()
        return loaded

    def check_weights(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]],
                      strict: bool = True) -> None:
        """Raise as load_weights would for tensors of these names and shapes, copying nothing:
        with several ranks, every one checks before any one loads."""
        self._plan(((n, torch.empty(s, device="meta")) for n, s in named_shapes), strict)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights under the names a checkpoint of this family gives each part (a model
        whose weights also arrive fused or stacked splits them here)."""
        return weights

    def local_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """What of `weights` this rank holds: (its parameter's name, its part of the tensor,
        a view), or (name, None) for another pipeline stage's. Weights no parameter takes
        (a tied head, rotary tables) are left out."""
        for name, tensor in self.checkpoint_weights(weights):
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if "rotary_emb.inv_freq" in name:
                continue
            if not self.sharder.owns(name):
                yield name, None
                continue
            if self.lm_head is not None and name == "model.embed_tokens.weight" \
                    and self.model.embed_tokens is None:
                name = "lm_head.weight"   # the last stage's copy of a tied embedding
            yield name, self.sharder.shard(name, tensor)

    def _plan(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool,
              local: bool = False) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], set[str]]:
        """(parameter slice, tensor) copies for `weights` (with local=True, local_weights'
        output), and the names they consume."""
        params = dict(self.named_parameters())
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        loaded: set[str] = set()
        covered: set[str] = set()
        for name, tensor in weights if local else self.local_weights(weights):
            if tensor is None:
                loaded.add(name)   # another pipeline stage's
                continue
            fused = self._fused_target(name)
            if fused is not None:
                dst, offset, rows = fused
                param = params.get(dst)
                if param is None:
                    raise ValueError(f"unexpected weight {name!r}")
                target = param.data.narrow(0, offset, rows)
                covered.add(f"{dst}@{offset}")
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
                target = param.data
                covered.add(name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            plan.append((target, tensor))
            loaded.add(name)
        if strict:
            self._check_complete(covered)
        return plan, loaded

    def _check_complete(self, covered: set[str]) -> None:
        missing = []
        for name, param in self.named_parameters():
            offsets = self._fused_offsets(name)
            if offsets is None:
                if name not in covered:
                    missing.append(name)
                continue
            missing += [f"{name}@{o}" for o in offsets if f"{name}@{o}" not in covered]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers, each attending within the config's sliding window where it has one."""
