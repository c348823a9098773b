"""Linear layers for a few rows (a decode step at batch 1 to 4) in Triton, with the op before
them in the same launch, for the GPU path: a candidate, timed against what it would replace by
benchmarks/gpu/fused_ops.py, and taken by the triton backend's Llama-family layers on CUDA
(`enabled`; TREADLE_FEW_ROW_LINEARS=0 turns them off). On an H200 they took a Qwen3-0.6B decode
step at batch 1 from 1.92 to 1.82 ms, each fused launch 1.3-4x the path it replaces in a CUDA
graph (docs/performance.md, "On a GPU").

Why: at batch 1 a decode step's CUDA graph is about 280 small kernels (docs/performance.md, "On
a GPU"), and each costs a launch slot besides its reads. Three of a Llama layer's nine launches
are only a prologue of the GEMM after them:
- `add_norm_gemv`: the residual add and RMSNorm (RMSNorm.add_and_norm) before the qkv and
  gate/up projections: each program normalizes the rows itself, from their sum of squares, as
  it reads them; the first program writes the new residual stream.
- `silu_mul_gemv`: SiLU-and-mul before the down projection.
`gemv` is the plain product, to time against cuBLAS at these shapes (o_proj, the LM head).

The prologues are triton_ops.py's own arithmetic (its `_residual_sum`, `_rstd`, `_scale`,
`_silu` and `_gated`), so what reaches the product is the unfused path's input, but for the
norm's sum order. Each program takes
BLOCK_N output features of every row and walks K in BLOCK_K slices, multiplying in fp32 on
the CUDA cores: at a few rows the product is bound by reading the weight, not by arithmetic,
and BLOCK_N can be as small as the grid needs (tl.dot wants 16 rows and 16 columns).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from treadle.models.triton_ops import (_LAUNCH, _ROUND_IN_BITS, _gated, _residual_sum, _round,
                                       _rstd, _scale, _silu)

MAX_ROWS = 4   # rows a launch takes (a power of two): larger batches take cuBLAS's GEMMs
# "0": models never take these launches; "1": they do off CUDA too (the interpreter's tests).
ENV = "TREADLE_FEW_ROW_LINEARS"
PLAIN, ADD_NORM, SILU_MUL = 0, 1, 2   # the prologue
# Programs to aim for: a couple per SM of an H100/H200 (132), so that each SM has reads in
# flight while another waits. A first guess, timed by fused_ops.py.
_TARGET_PROGRAMS = 264


@triton.jit
def _prologue(x_ptr, r_ptr, norm_w_ptr, rows, row_ok, ks, k_ok, stride_x, stride_r, rstd,
              K: tl.constexpr, PROLOGUE: tl.constexpr, IN_BITS: tl.constexpr):
    """The product's input at rows x ks, as fp32 values of the model's dtype: x itself, the
    normalized x + residual (rstd per row), or silu(gate) * up of the fused gate/up output."""
    mask = row_ok[:, None] & k_ok[None, :]
    offs = rows[:, None] * stride_x + ks[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        r = tl.load(r_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
        h = _residual_sum(x, r, dtype, IN_BITS).to(tl.float32)
        w = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        a = _scale(h, rstd[:, None], w, dtype, dtype, False, IN_BITS)
    elif PROLOGUE == 2:
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        a = _gated(_silu(x.to(tl.float32)), up, dtype, IN_BITS)
    else:
        a = x
    return a.to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr,
                 num_rows, N, stride_x, stride_r, stride_w, stride_o, eps,
                 K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 IN_BITS: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    row_ok = rows < num_rows
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    dtype = x_ptr.dtype.element_ty
    rstd = tl.zeros([ROWS], tl.float32)
    if PROLOGUE == 1:
        # Each program finds the rows' norms itself (K is the hidden size: a few KB from L2),
        # and the first writes the new residual stream, x + residual, rounded as torch does.
        sum_sq = tl.zeros([ROWS], tl.float32)
        writes = rows < num_rows * (pid == 0).to(tl.int32)   # the first program's rows
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (ks < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
            r = tl.load(r_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
            h = _residual_sum(x, r, dtype, IN_BITS)
            tl.store(res_out_ptr + rows[:, None] * K + ks[None, :], h,
                     mask=writes[:, None] & (ks < K)[None, :])
            h = h.to(tl.float32)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = _rstd(sum_sq, eps, K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = _prologue(x_ptr, r_ptr, norm_w_ptr, rows, row_ok, ks, k_ok, stride_x, stride_r,
                      rstd, K, PROLOGUE, IN_BITS)
        w = tl.load(w_ptr + ns.to(tl.int64)[:, None] * stride_w + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for row in tl.static_range(ROWS):
            a_row = tl.sum(tl.where(rows[:, None] == row, a, 0.0), axis=0)
            part = tl.sum(w * a_row[None, :], axis=1)
            acc += tl.where(rows[:, None] == row, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + ns[None, :],
             _round(acc, out_ptr.dtype.element_ty, IN_BITS),
             mask=row_ok[:, None] & n_ok[None, :])


def enabled(device: torch.device) -> bool:
    """Whether the triton backend's models fuse their few-row steps here (llama.py's
    DecoderLayer.few_row_linears): on CUDA, unless ENV is "0"; elsewhere (Triton's interpreter)
    only where it is "1"."""
    setting = os.environ.get(ENV)
    return setting == "1" or (setting != "0" and device.type == "cuda")


def serves(rows: int, weight: torch.Tensor) -> bool:
    """Whether a launch here takes `rows` rows through `weight` ([out, in], K contiguous)."""
    return 0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.stride(1) == 1


def launch_shape(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight: about _TARGET_PROGRAMS programs
    where n allows. First guesses, to be timed on a GPU."""
    block_k = min(512, triton.next_power_of_2(k))
    block_n = triton.next_power_of_2(max(1, n // _TARGET_PROGRAMS))
    # A slice of 2,048-8,192 weights: 4-16 KB in bf16, and at most 64 registers a thread of
    # 4 warps for it in fp32 (compiled for sm_90 with Triton 3.9: 40-80 registers at one row,
    # 64-167 at four, no spills).
    block_n = max(2048 // block_k, min(block_n, 8192 // block_k))
    return block_n, block_k, 4


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
            prologue: int, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, n = x.shape[0], weight.shape[0]
    width = 2 * k if prologue == SILU_MUL else k
    if (x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or not serves(rows, weight)
            or weight.shape[1] != k):
        raise ValueError(f"a few-row linear takes x [1..{MAX_ROWS}, {width}] and a weight [out, "
                         f"{k}], both with contiguous rows; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(rows, k, dtype=x.dtype, device=x.device) if residual is not None else None
    shape_n, block_k, warps = launch_shape(n, k)
    block_n = block_n or shape_n
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        weight, bias if bias is not None else weight, out, res_out if res_out is not None else out,
        rows, n, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0), eps, K=k, ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n,
        BLOCK_K=block_k, PROLOGUE=prologue, HAS_BIAS=bias is not None, IN_BITS=_ROUND_IN_BITS,
        num_warps=warps, **_LAUNCH)
    return out, res_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block_n: int | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias), rows at most MAX_ROWS."""
    return _launch(x, weight, bias, weight.shape[1], PLAIN, block_n=block_n)[0]


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  block_n: int | None = None) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up output [rows, 2 * I], @ weight[out, I].T (+ bias):
    the MLP's activation and down projection in one launch."""
    return _launch(gate_up, weight, bias, weight.shape[1], SILU_MUL, block_n=block_n)[0]


def add_norm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T (+ bias), x + residual): add_and_norm and the
    projection after it in one launch. The new residual stream is a new tensor: every program
    reads the old one while the first writes."""
    if x.shape != residual.shape or x.dtype != residual.dtype or residual.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match, with contiguous rows")
    out, res_out = _launch(x, weight, bias, weight.shape[1], ADD_NORM, residual, norm_weight, eps,
                           block_n=block_n)
    return out, res_out
