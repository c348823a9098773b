"""The decoder's elementwise ops in Triton, for the GPU path: RMSNorm (Llama's and Gemma's
(1 + weight) form), the residual add fused into the norm after it, SiLU-and-mul and GeGLU
(tanh), RoPE applied to q and k in place, and Qwen3's q/k head norms with RoPE in one launch.
The RoPE kernels can also write the layer's new K/V into the paged cache as they make K,
which spares the attention backend's own write launch (attention/backend.py, `kv_target`).

Each op does the torch path's arithmetic (treadle/models/llama.py, gemma.py, rope.py) in the
same order with the same roundings: fp32 inside, and a value rounded to the model's dtype
wherever torch rounds it (the normalized row before the weight, SiLU before the product, each
RoPE product), so bf16 outputs are torch's but for the norms' sum order and the exp of the
activations; in fp32 only those differ, by an ulp or so. The launches turn off fp
contraction (`enable_fp_fusion=False`): an FMA rounds once where torch rounds twice, and these
kernels are bound by memory, not arithmetic. The norm divides with `div_rn` and `sqrt_rn`,
as torch's CPU rsqrt (1 / sqrt, both IEEE); a GPU's default `/` is approximate.

Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) rounds fp32 to bf16 by truncation;
under it `_round` rounds to nearest even in integer bits first, so the interpreted kernels
round as a GPU does. Triton decides at definition whether a kernel is interpreted, so this
module is imported only where it runs (treadle imports without triton).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from treadle.attention.backend import KVTarget

# Round to bf16 in integer bits: under the interpreter only (see the module's docstring).
_ROUND_IN_BITS = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH = {"enable_fp_fusion": False}
# torch's gelu(approximate="tanh") constants: sqrt(2 / pi) and 0.044715
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)
_ACT_BLOCK = 1024   # at most this many features of a row per program of the activation kernel
_TILE = 2048        # elements a program takes, about, where rows are shorter


@triton.jit
def _round(x, dtype: tl.constexpr, IN_BITS: tl.constexpr):
    """fp32 `x` rounded to `dtype`, to nearest even."""
    if IN_BITS and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)   # exact in bf16 now
    return x.to(dtype)


@triton.jit
def _rstd(sum_sq, eps, D: tl.constexpr):
    """1 / sqrt(mean square + eps) per row, from the rows' sums of squares over D features."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sum_sq, D + 0.0) + eps))


@triton.jit
def _scale(h, rstd, w, in_dtype: tl.constexpr, out_dtype: tl.constexpr,
           UNIT_OFFSET: tl.constexpr, IN_BITS: tl.constexpr):
    """The fp32 rows `h` normalized by `rstd` ([rows, 1]) and the fp32 weights `w` ([1, cols]),
    rounded to `out_dtype`: Llama's weight * (h * rstd).to(dtype), or with UNIT_OFFSET Gemma's
    h * rstd * (1 + weight)."""
    if UNIT_OFFSET:
        y = h * rstd * (1.0 + w)
    else:
        y = _round(h * rstd, in_dtype, IN_BITS).to(tl.float32) * w
    return _round(y, out_dtype, IN_BITS)


@triton.jit
def _normalize(h, w_ptr, cols, col_ok, eps, D: tl.constexpr, in_dtype: tl.constexpr,
               out_dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr, IN_BITS: tl.constexpr):
    """RMSNorm of the fp32 rows `h` [rows, BLOCK] (zeros past D), rounded to `out_dtype`."""
    rstd = _rstd(tl.sum(h * h, axis=1), eps, D)[:, None]
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return _scale(h, rstd, w, in_dtype, out_dtype, UNIT_OFFSET, IN_BITS)


@triton.jit
def _residual_sum(x, r, dtype: tl.constexpr, IN_BITS: tl.constexpr):
    """x + residual, rounded to the model's dtype as torch's add is."""
    return _round(x.to(tl.float32) + r.to(tl.float32), dtype, IN_BITS)


@triton.jit
def _silu(gate):
    """silu of fp32 `gate`, its division IEEE (a GPU's default `/` is approximate)."""
    return tl.math.div_rn(gate, 1.0 + tl.exp(-gate))


@triton.jit
def _gated(act, up, dtype: tl.constexpr, IN_BITS: tl.constexpr):
    """act * up of an activation and mul, each rounded to `dtype` as torch rounds them."""
    return _round(_round(act, dtype, IN_BITS).to(tl.float32) * up, dtype, IN_BITS)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_xt, stride_xh, num_rows, num_heads, eps,
                     D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, IN_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < D
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    starts = (rows // num_heads) * stride_xt + (rows % num_heads) * stride_xh
    x = tl.load(x_ptr + starts[:, None] + cols[None, :], mask=mask, other=0.0)
    y = _normalize(x.to(tl.float32), w_ptr, cols, col_ok, eps, D, x_ptr.dtype.element_ty,
                   out_ptr.dtype.element_ty, UNIT_OFFSET, IN_BITS)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y, mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, residual_ptr, w_ptr, stride_x, stride_r, num_rows, eps,
                               D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                               IN_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < D
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    r_ptrs = residual_ptr + rows[:, None] * stride_r + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    r = tl.load(r_ptrs, mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    h = _residual_sum(x, r, dtype, IN_BITS)
    tl.store(r_ptrs, h, mask=mask)
    y = _normalize(h.to(tl.float32), w_ptr, cols, col_ok, eps, D, dtype, dtype, False, IN_BITS)
    tl.store(x_ptrs, y, mask=mask)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, num_rows, I: tl.constexpr,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, GELU_TANH: tl.constexpr,
                        IN_BITS: tl.constexpr):
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < num_rows) & (cols < I)
    gate_ptrs = x_ptr + rows * stride_x + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GELU_TANH:   # torch's order: 0.5 * x * (1 + tanh(beta * (x + kappa * x**3)))
        inner = _GELU_BETA * (gate + _GELU_KAPPA * (gate * gate * gate))
        t = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.math.div_rn(1.0 - t, 1.0 + t)
        tanh = tl.where(inner < 0, -tanh, tanh)
        act = 0.5 * gate * (1.0 + tanh)
    else:
        act = _silu(gate)
    tl.store(out_ptr + rows * I + cols, _gated(act, up, dtype, IN_BITS), mask=mask)


@triton.jit
def _cos_sin_halves(cos_ptr, sin_ptr, tokens, token_ok, stride_cos, stride_sin, d, d_ok,
                    HALF: tl.constexpr):
    """Some tokens' cos and sin tables in fp32, each as its halves [tokens, 1, HALF_PAD]."""
    mask = token_ok[:, None] & d_ok[None, :]
    cos = cos_ptr + tokens[:, None] * stride_cos + d[None, :]
    sin = sin_ptr + tokens[:, None] * stride_sin + d[None, :]
    c1 = tl.load(cos, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(cos + HALF, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(sin, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(sin + HALF, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    return c1, c2, s1, s2


@triton.jit
def _store_rotated(ptrs, x1, x2, c1, c2, s1, s2, mask, dtype: tl.constexpr,
                   HALF: tl.constexpr, IN_BITS: tl.constexpr):
    """x * cos + rotate_half(x) * sin of the fp32 halves x1, x2, stored at ptrs and ptrs + HALF,
    each product rounded to the dtype as torch rounds it; returns the two halves stored."""
    a = _round(x1 * c1, dtype, IN_BITS).to(tl.float32)
    b = _round(x2 * s1, dtype, IN_BITS).to(tl.float32)
    c = _round(x2 * c2, dtype, IN_BITS).to(tl.float32)
    e = _round(x1 * s2, dtype, IN_BITS).to(tl.float32)
    y1 = _round(a - b, dtype, IN_BITS)
    y2 = _round(c + e, dtype, IN_BITS)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotate_heads(x_ptr, tokens, token_ok, stride_t, stride_h, num_heads, c1, c2, s1, s2, d,
                  d_ok, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, IN_BITS: tl.constexpr):
    """Some tokens' heads rotated in place over their first 2 * HALF features. Tiles are
    [tokens, heads, HALF_PAD]; cos and sin halves [tokens, 1, HALF_PAD]. Returns the rotated
    halves and their mask."""
    heads = tl.arange(0, HEADS_PAD)[None, :, None]
    mask = token_ok[:, None, None] & (heads < num_heads) & d_ok[None, None, :]
    ptrs = x_ptr + tokens[:, None, None] * stride_t + heads * stride_h + d[None, None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _store_rotated(ptrs, x1, x2, c1, c2, s1, s2, mask, x_ptr.dtype.element_ty, HALF,
                            IN_BITS)
    return y1, y2, mask


@triton.jit
def _write_kv_heads(k1, k2, mask, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, tokens, token_ok,
                    stride_vt, stride_vh, stride_cb, stride_cp, stride_ch, d,
                    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Some tokens' new K (its halves k1, k2 as rotated, under `mask`, [tokens, heads,
    HALF_PAD]) and V (read at v_ptr) into the paged cache at their slots, as
    attention/triton_kv_write.py writes them: a negative slot (padding) writes nothing."""
    slots = tl.load(slot_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    ok = mask & (slots >= 0)[:, None, None]
    slots = tl.where(slots >= 0, slots, 0)
    heads = tl.arange(0, HEADS_PAD)[None, :, None]
    at = ((slots // BLOCK_SIZE) * stride_cb + (slots % BLOCK_SIZE) * stride_cp)[:, None, None] \
        + heads * stride_ch + d[None, None, :]
    tl.store(k_cache_ptr + at, k1, mask=ok)
    tl.store(k_cache_ptr + at + HALF, k2, mask=ok)
    v = v_ptr + tokens[:, None, None] * stride_vt + heads * stride_vh + d[None, None, :]
    tl.store(v_cache_ptr + at, tl.load(v, mask=ok), mask=ok)
    tl.store(v_cache_ptr + at + HALF, tl.load(v + HALF, mask=ok), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                 stride_vt, stride_vh, stride_cb, stride_cp, stride_ch,
                 num_tokens, num_q_heads, num_k_heads,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                 K_HEADS_PAD: tl.constexpr, TOKENS: tl.constexpr, IN_BITS: tl.constexpr,
                 WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """q and k rotated in place; with WRITE_KV, k as rotated and v into the paged cache too
    (heads rotated whole)."""
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    token_ok = tokens < num_tokens
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    c1, c2, s1, s2 = _cos_sin_halves(cos_ptr, sin_ptr, tokens, token_ok, stride_cos, stride_sin,
                                     d, d_ok, HALF)
    _rotate_heads(q_ptr, tokens, token_ok, stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2,
                  d, d_ok, HALF, Q_HEADS_PAD, IN_BITS)
    k1, k2, k_mask = _rotate_heads(k_ptr, tokens, token_ok, stride_kt, stride_kh, num_k_heads,
                                   c1, c2, s1, s2, d, d_ok, HALF, K_HEADS_PAD, IN_BITS)
    if WRITE_KV:
        _write_kv_heads(k1, k2, k_mask, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, tokens,
                        token_ok, stride_vt, stride_vh, stride_cb, stride_cp, stride_ch, d,
                        HALF, K_HEADS_PAD, BLOCK_SIZE)


@triton.jit
def _norm_rotate_heads(x_ptr, out_ptr, w_ptr, tokens, token_ok, stride_t, stride_h, num_heads,
                       eps, c1, c2, s1, s2, d, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                       IN_BITS: tl.constexpr):
    """Some tokens' heads RMSNormed (Llama's form) into `out_ptr` ([tokens, heads, 2 * HALF],
    contiguous), then rotated there: rms_norm, then _rotate_heads, in one pass. The sum of
    squares is over whole rows, as _normalize's, so each value is the two kernels' own.
    Returns the rotated halves and their mask."""
    heads = tl.arange(0, HEADS_PAD)[None, :, None]
    mask = token_ok[:, None, None] & (heads < num_heads)
    rows = x_ptr + tokens[:, None, None] * stride_t + heads * stride_h
    whole = tl.load(rows + tl.arange(0, 2 * HALF)[None, None, :], mask=mask,
                    other=0.0).to(tl.float32)
    mean = tl.math.div_rn(tl.sum(whole * whole, axis=2), 2.0 * HALF)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))[:, :, None]
    dtype = x_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + d).to(tl.float32)[None, None, :]
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, None, :]
    x1 = tl.load(rows + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x1 = _round(_round(x1 * rstd, dtype, IN_BITS).to(tl.float32) * w1, dtype, IN_BITS).to(tl.float32)
    x2 = _round(_round(x2 * rstd, dtype, IN_BITS).to(tl.float32) * w2, dtype, IN_BITS).to(tl.float32)
    out = out_ptr + (tokens[:, None, None] * num_heads + heads) * (2 * HALF) + d[None, None, :]
    y1, y2 = _store_rotated(out, x1, x2, c1, c2, s1, s2, mask, dtype, HALF, IN_BITS)
    return y1, y2, mask


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                         v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                         stride_vt, stride_vh, stride_cb, stride_cp, stride_ch,
                         num_tokens, num_q_heads, num_k_heads, eps, HALF: tl.constexpr,
                         Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                         TOKENS: tl.constexpr, IN_BITS: tl.constexpr, WRITE_KV: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr):
    """_norm_rotate_heads over q and k; heads rotated whole, so HALF is a power of two. With
    WRITE_KV, k as rotated and v into the paged cache too."""
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    token_ok = tokens < num_tokens
    d = tl.arange(0, HALF)
    c1, c2, s1, s2 = _cos_sin_halves(cos_ptr, sin_ptr, tokens, token_ok, stride_cos, stride_sin,
                                     d, d < HALF, HALF)
    _norm_rotate_heads(q_ptr, q_out_ptr, q_w_ptr, tokens, token_ok, stride_qt, stride_qh,
                       num_q_heads, eps, c1, c2, s1, s2, d, HALF, Q_HEADS_PAD, IN_BITS)
    k1, k2, k_mask = _norm_rotate_heads(k_ptr, k_out_ptr, k_w_ptr, tokens, token_ok, stride_kt,
                                        stride_kh, num_k_heads, eps, c1, c2, s1, s2, d, HALF,
                                        K_HEADS_PAD, IN_BITS)
    if WRITE_KV:
        _write_kv_heads(k1, k2, k_mask, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, tokens,
                        token_ok, stride_vt, stride_vh, stride_cb, stride_cp, stride_ch, d,
                        HALF, K_HEADS_PAD, BLOCK_SIZE)


def _tile(block: int) -> tuple[int, int]:
    """(rows a program takes, its warps) for rows of `block` elements: short rows (a head's
    norm, a small model's) share a program up to _TILE elements, and a warp per 256 of them
    keeps the loads in flight without idle threads. First guesses, to be measured on a GPU."""
    rows = max(1, _TILE // block)
    return rows, max(1, min(8, rows * block // 256))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [tokens, heads, features] with the features contiguous: a view where it can be."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x if x.dim() == 3 else x.reshape(-1, x.shape[-2], x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over x's last dim (any leading dims and strides, e.g. Qwen3's q heads inside
    the fused qkv output): Llama's `weight * normalized.to(dtype)`, or with unit_offset
    Gemma's `(normalized * (1 + weight)).to(dtype)`. A new contiguous tensor."""
    dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows = _as_rows(x)
    d = x.shape[-1]
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(d)
    per_program, warps = _tile(block)
    num_rows = rows.shape[0] * rows.shape[1]
    _rms_norm_kernel[(triton.cdiv(num_rows, per_program),)](
        rows, weight, out, rows.stride(0), rows.stride(1), num_rows, rows.shape[1], eps,
        D=d, BLOCK=block, ROWS=per_program, UNIT_OFFSET=unit_offset, IN_BITS=_ROUND_IN_BITS,
        num_warps=warps, **_LAUNCH)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, one pass: residual += x, then x = RMSNorm(residual), as RMSNorm.add_and_norm
    computes them. x and residual: [tokens, hidden] of one dtype, rows of contiguous features.
    Returns (x, residual): the normalized rows and the new residual stream."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match")
    if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("fused_add_rms_norm takes [tokens, hidden] with contiguous rows")
    if x.shape[0] == 0:
        return x, residual
    block = triton.next_power_of_2(x.shape[1])
    per_program, warps = _tile(block)
    _fused_add_rms_norm_kernel[(triton.cdiv(x.shape[0], per_program),)](
        x, residual, weight, x.stride(0), residual.stride(0), x.shape[0], eps,
        D=x.shape[1], BLOCK=block, ROWS=per_program, IN_BITS=_ROUND_IN_BITS,
        num_warps=warps, **_LAUNCH)
    return x, residual


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, x.shape[-1])
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(_ACT_BLOCK, triton.next_power_of_2(inter))
    per_program, warps = _tile(block)
    _act_and_mul_kernel[(triton.cdiv(rows.shape[0], per_program), triton.cdiv(inter, block))](
        rows, out, rows.stride(0), rows.shape[0], I=inter, BLOCK=block, ROWS=per_program,
        GELU_TANH=gelu_tanh, IN_BITS=_ROUND_IN_BITS, num_warps=warps, **_LAUNCH)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection's output [..., 2 * I] -> [..., I]."""
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU: gelu(gate, approximate="tanh") * up, [..., 2 * I] -> [..., I]."""
    return _act_and_mul(gate_up, gelu_tanh=True)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          write_kv: tuple[torch.Tensor, KVTarget] | None = None) -> None:
    """Rotate q [tokens, q heads, head dim] and k [tokens, kv heads, head dim] in place, as
    rope.apply_rope does (neox rotate-half over the first cos.shape[-1] features; the rest
    pass through). cos, sin: [tokens, rotary dim] or RotaryEmbedding's [tokens, 1, rotary dim].
    q and k may be strided views (of the fused qkv output); each head's features contiguous.
    `write_kv`: (v, where the layer's K/V go): k as rotated and v into the paged cache too, in
    the same launch (heads rotated whole only)."""
    rot = cos.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_ rotates in place: each head's features must be contiguous")
    if rot % 2 or rot > q.shape[-1] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same tokens "
                         f"and head dim, and rotary dim {rot} be even and at most the head dim")
    if write_kv is not None and rot != q.shape[-1]:
        raise ValueError(f"rope_ writes K/V only for heads rotated whole: rotary dim {rot}, "
                         f"head dim {q.shape[-1]}")
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    cos, sin = cos.reshape(num_tokens, rot), sin.reshape(num_tokens, rot)
    half = rot // 2
    half_pad = triton.next_power_of_2(half)
    q_pad, k_pad = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    per_program, warps = _tile(max(q_pad, k_pad) * half_pad)
    kv_ptrs, kv_strides, block_size = _kv_launch(write_kv, k, q)
    _rope_kernel[(triton.cdiv(num_tokens, per_program),)](
        q, k, cos, sin, *kv_ptrs, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), *kv_strides, num_tokens, q.shape[1], k.shape[1],
        HALF=half, HALF_PAD=half_pad, Q_HEADS_PAD=q_pad, K_HEADS_PAD=k_pad, TOKENS=per_program,
        IN_BITS=_ROUND_IN_BITS, WRITE_KV=write_kv is not None, BLOCK_SIZE=block_size,
        num_warps=warps, **_LAUNCH)


def _kv_launch(write_kv: tuple[torch.Tensor, KVTarget] | None, k: torch.Tensor,
               stand_in: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], int]:
    """The kernels' K/V-write arguments, checked against k: the v, k_cache, v_cache and slot
    pointers; v's token and head strides and the cache's block, position and head strides;
    the cache's block size. Where nothing is written, `stand_in` takes the pointers' place
    (never read)."""
    if write_kv is None:
        return (stand_in,) * 4, (0,) * 5, 1
    v, (k_cache, v_cache, slot_mapping) = write_kv
    if (v.shape != k.shape or v.stride(-1) != 1 or k_cache.shape != v_cache.shape
            or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != k.shape[1:]
            or k_cache.stride(-1) != 1 or slot_mapping.shape[0] < k.shape[0]):
        raise ValueError(f"write_kv takes v as k {tuple(k.shape)} with contiguous features, "
                         f"and caches [blocks, block size, kv heads, head dim] of one layout "
                         f"with a slot per token: v {tuple(v.shape)}, caches "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}, "
                         f"{slot_mapping.shape[0]} slots")
    strides = (v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    return (v, k_cache, v_cache, slot_mapping), strides, k_cache.shape[1]


def fuses_qk_norm_rope(head_dim: int, rotary_dim: int) -> bool:
    """Whether qk_norm_rope serves these heads: rotated whole, of a power-of-two size."""
    return rotary_dim == head_dim and head_dim >= 2 and head_dim & (head_dim - 1) == 0


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 write_kv: tuple[torch.Tensor, KVTarget] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's q and k head norms (Llama's RMSNorm per head) and RoPE in one launch, where
    rms_norm twice and rope_ take three: new contiguous q [tokens, q heads, head dim] and k,
    with the values of those three. q, k: strided views (of the fused qkv output), each head's
    features contiguous; the weights of their dtype; heads rotated whole (fuses_qk_norm_rope).
    `write_kv`: as rope_'s, k as returned and v into the paged cache in the same launch."""
    num_tokens, head_dim = q.shape[0], q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != num_tokens:
        raise ValueError(f"qk_norm_rope takes q and k as [tokens, heads, head dim] with the same "
                         f"tokens: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not fuses_qk_norm_rope(head_dim, cos.shape[-1]) or k.shape[-1] != head_dim:
        raise ValueError(f"qk_norm_rope rotates whole heads of a power-of-two size: q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, rotary dim {cos.shape[-1]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rope takes heads whose features are contiguous")
    if not q.dtype == k.dtype == q_weight.dtype == k_weight.dtype:
        raise ValueError(f"q, k and the norms' weights must share a dtype: {q.dtype}, {k.dtype}, "
                         f"{q_weight.dtype}, {k_weight.dtype}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    q_pad, k_pad = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    per_program, warps = _tile(max(q_pad, k_pad) * head_dim)
    kv_ptrs, kv_strides, block_size = _kv_launch(write_kv, k, q)
    _qk_norm_rope_kernel[(triton.cdiv(num_tokens, per_program),)](
        q, k, q_out, k_out, q_weight, k_weight, cos, sin, *kv_ptrs, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), *kv_strides, num_tokens,
        q.shape[1], k.shape[1], eps, HALF=head_dim // 2, Q_HEADS_PAD=q_pad, K_HEADS_PAD=k_pad,
        TOKENS=per_program, IN_BITS=_ROUND_IN_BITS, WRITE_KV=write_kv is not None,
        BLOCK_SIZE=block_size, num_warps=warps, **_LAUNCH)
    return q_out, k_out
