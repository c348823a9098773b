"""The decoder's Triton ops (treadle/models/triton_ops.py) against the torch path they replace
(RMSNorm and add_and_norm in llama.py, GemmaRMSNorm, SiLU / GeGLU and mul, rope.apply_rope,
Qwen3's head norms then RoPE; the last fused into one launch, also against the three it saves):
on the CPU through Triton's interpreter, compiled to H100 code without a GPU, and (`gpu`) on a
CUDA device.

What must be exact and what may differ: the residual add and RoPE do torch's roundings one for
one, so they are equal bit for bit in fp32 and bf16; the norms sum in another order and the
activations take another exp, so they are within an fp32 ulp or two, or a bf16 ulp.

As in test_triton_attention.py, the interpreted cases run in a fresh Python with
TRITON_INTERPRET=1 (Triton decides when a kernel is defined whether it is interpreted).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.fresh_python import in_fresh_python
from treadle.models.gemma import GemmaRMSNorm
from treadle.models.llama import RMSNorm
from treadle.models.rope import RotaryEmbedding, apply_rope

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-6
# Largest |got - ref| / (|ref| + 1): relative for large values, absolute near zero.
FP32_TOL = 2e-6
FP32_TOL_CUDA = 1e-5   # a GPU's exp is approximate, and torch's CUDA rsqrt too
# torch's GeGLU takes 1 + tanh(u) near tanh = -1 (gate about -5), where an ulp of tanh is all
# of the result's digits: about 1e-7 * |gate * up| apart, in torch's formula as in ours.
GELU_FP32_TOL = 2e-5
BF16_TOL = 1e-2        # one bf16 rounding the other way

# name -> (op, shape): norm cases are (tokens, heads or None, hidden); act cases (tokens,
# intermediate); rope cases (tokens, q heads, kv heads, head dim, partial rotary factor).
CASES = {
    "norm_1024": ("norm", (3, None, 1024)),
    "norm_odd_77": ("norm", (5, None, 77)),
    "norm_qwen3_heads_in_qkv": ("norm", (4, 6, 128)),   # q heads, a strided view of qkv
    "gemma_norm_odd_77": ("gemma_norm", (5, None, 77)),
    "gemma_norm_heads_in_qkv": ("gemma_norm", (3, 4, 48)),
    "add_norm_1024": ("add_norm", (3, None, 1024)),
    "add_norm_odd_77": ("add_norm", (6, None, 77)),
    "silu_two_blocks_1500": ("silu", (4, 1500)),   # 1024 features a program: a masked tail
    "silu_odd_37": ("silu", (5, 37)),
    "gelu_tanh_1500": ("gelu_tanh", (4, 1500)),
    "rope_gqa3_d64": ("rope", (5, 6, 2, 64, 1.0)),
    "rope_partial_d48": ("rope", (5, 6, 2, 48, 0.75)),   # 36 rotary features: half of 18
    "rope_mha_d80": ("rope", (3, 5, 5, 80, 1.0)),
    # Qwen3's q/k head norms and RoPE in one launch: (tokens, q heads, kv heads, head dim)
    "qk_norm_rope_qwen3": ("qk_norm_rope", (5, 16, 8, 128)),
    "qk_norm_rope_gqa3_d64": ("qk_norm_rope", (3, 6, 2, 64)),
    # The same launches writing K/V into a paged cache as they make K: (tokens, q heads, kv
    # heads, head dim); a padding token (slot -1) among them.
    "rope_writes_kv_d64": ("rope_kv", (6, 6, 2, 64)),
    "rope_writes_kv_mha_d80": ("rope_kv", (4, 5, 5, 80)),
    "qk_norm_rope_writes_kv_qwen3": ("qk_norm_rope_kv", (5, 16, 8, 128)),
}
# What must be equal bit for bit; of the fused K/V writes, the cache and q and k both.
EXACT = {"add_norm": ("residual",), "rope": ("out",), "rope_kv": ("out", "cache"),
         "qk_norm_rope_kv": ("out", "cache")}
# Under the interpreter also the fused norms and RoPE to the two norm launches and the RoPE
# launch they replace ("unfused"): the same sums of squares. A GPU may sum a row in another
# order in another tile shape.
EXACT_INTERPRETED = {**EXACT, "qk_norm_rope": ("unfused",)}


def _random(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _norm_case(op: str, shape: tuple, dtype: torch.dtype, device: torch.device, gen) -> dict:
    from treadle.models import triton_ops

    tokens, heads, dim = shape
    cls = GemmaRMSNorm if op == "gemma_norm" else RMSNorm
    norm = cls(dim, EPS).to(device=device, dtype=dtype)
    norm.weight.data.copy_(_random(gen, dim, scale=0.5) + (0 if op == "gemma_norm" else 1))
    width = (heads or 1) * dim
    rows = _random(gen, tokens, width + 40, scale=3.0).to(device=device, dtype=dtype)
    x = rows[:, :width]   # rows apart, as a view of a fused projection gives them
    if heads is not None:
        x = x.view(tokens, heads, dim)
    if op == "add_norm":
        residual = _random(gen, tokens, dim, scale=3.0).to(device=device, dtype=dtype)
        want_residual, want = norm.add_and_norm(x, residual)
        got, got_residual = triton_ops.fused_add_rms_norm(rows.clone()[:, :width],
                                                          residual.clone(), norm.weight, EPS)
        return {"out": (got, want), "residual": (got_residual, want_residual)}
    got = triton_ops.rms_norm(x, norm.weight, EPS, unit_offset=op == "gemma_norm")
    return {"out": (got, norm(x))}


def _act_case(op: str, shape: tuple, dtype: torch.dtype, device: torch.device, gen) -> dict:
    from treadle.models import triton_ops

    tokens, inter = shape
    gate_up = _random(gen, tokens, 2 * inter, scale=3.0).to(device=device, dtype=dtype)
    gate, up = gate_up.split(inter, dim=-1)
    if op == "silu":   # MLP.forward and GemmaMLP.forward
        return {"out": (triton_ops.silu_and_mul(gate_up), nn.functional.silu(gate) * up)}
    return {"out": (triton_ops.gelu_tanh_and_mul(gate_up),
                    nn.functional.gelu(gate, approximate="tanh") * up)}


def _rope_case(shape: tuple, dtype: torch.dtype, device: torch.device, gen) -> dict:
    from treadle.models import triton_ops

    tokens, hq, hkv, head_dim, factor = shape
    config = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=factor)
    rotary = RotaryEmbedding(config, head_dim, 4096).to(device)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    cos, sin = rotary(positions, dtype)
    # q and k as the model has them: views of the fused qkv output
    qkv = _random(gen, tokens, (hq + 2 * hkv) * head_dim).to(device=device, dtype=dtype)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    want = torch.cat([apply_rope(q, cos, sin), apply_rope(k, cos, sin)], dim=1)
    before_v = qkv[:, (hq + hkv) * head_dim:].clone()
    triton_ops.rope_(q, k, cos, sin)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], before_v), "rope_ wrote past k"
    return {"out": (torch.cat([q, k], dim=1), want)}


def _qk_norm_rope_case(shape: tuple, dtype: torch.dtype, device: torch.device, gen) -> dict:
    from treadle.models import triton_ops

    tokens, hq, hkv, head_dim = shape
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), head_dim, 4096).to(device)
    cos, sin = rotary(torch.randint(0, 4096, (tokens,), generator=gen).to(device), dtype)
    norms = []
    for _ in range(2):
        norm = RMSNorm(head_dim, EPS).to(device=device, dtype=dtype)
        norm.weight.data.copy_(_random(gen, head_dim, scale=0.5) + 1)
        norms.append(norm)
    qkv = _random(gen, tokens, (hq + 2 * hkv) * head_dim, scale=3.0).to(device=device, dtype=dtype)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    want = torch.cat([apply_rope(norms[0](q), cos, sin), apply_rope(norms[1](k), cos, sin)], dim=1)
    unfused_q = triton_ops.rms_norm(q, norms[0].weight, EPS)
    unfused_k = triton_ops.rms_norm(k, norms[1].weight, EPS)
    triton_ops.rope_(unfused_q, unfused_k, cos, sin)
    before = qkv.clone()
    got_q, got_k = triton_ops.qk_norm_rope(q, k, norms[0].weight, norms[1].weight, EPS, cos, sin)
    assert torch.equal(qkv, before), "qk_norm_rope wrote into its input"
    got = torch.cat([got_q, got_k], dim=1)
    return {"out": (got, want), "unfused": (got, torch.cat([unfused_q, unfused_k], dim=1))}


def _writes_kv_case(op: str, shape: tuple, dtype: torch.dtype, device: torch.device, gen) -> dict:
    """rope_ or qk_norm_rope writing K/V into a paged cache in their launch, against the same
    op without, then the attention backend's write_kv: the q and k out equal, the caches
    equal (every slot, the ones a padding token would have hit included)."""
    from treadle.attention.backend import KVTarget
    from treadle.attention.triton_kv_write import write_kv
    from treadle.models import triton_ops

    tokens, hq, hkv, head_dim = shape
    block_size, num_blocks = 4, 5
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), head_dim, 4096).to(device)
    cos, sin = rotary(torch.randint(0, 4096, (tokens,), generator=gen).to(device), dtype)
    qkv = _random(gen, tokens, (hq + 2 * hkv) * head_dim, scale=3.0).to(device=device, dtype=dtype)
    weights = [(_random(gen, head_dim, scale=0.5) + 1).to(device=device, dtype=dtype)
               for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1   # a padding token: nothing written
    slots = slots.to(device=device, dtype=torch.int32)   # as the backend and the graphs hold them

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = qkv.clone()
        q = x[:, :hq * head_dim].view(tokens, hq, head_dim)
        k = x[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
        v = x[:, (hq + hkv) * head_dim:].view(tokens, hkv, head_dim)
        cache = torch.full((2, num_blocks, block_size, hkv, head_dim), -7.0, dtype=dtype,
                           device=device)
        target = (v, KVTarget(cache[0], cache[1], slots)) if fused else None
        if op == "rope_kv":
            triton_ops.rope_(q, k, cos, sin, target)
        else:
            q, k = triton_ops.qk_norm_rope(q, k, *weights, EPS, cos, sin, target)
        if not fused:
            write_kv(k, v, cache[0], cache[1], slots)
        return torch.cat([q, k], dim=1), cache

    (out, cache), (want_out, want_cache) = run(fused=True), run(fused=False)
    return {"out": (out, want_out), "cache": (cache, want_cache)}


def compare_ops(dtype_name: str, device_name: str) -> dict[str, dict[str, dict]]:
    """Every case's Triton op beside the torch path on the same inputs: per output, whether
    they are equal and their largest |difference| / (|torch's| + 1)."""
    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    results = {}
    for name, (op, shape) in CASES.items():
        gen = torch.Generator().manual_seed(sum(map(ord, name)))
        if op == "rope":
            pairs = _rope_case(shape, dtype, device, gen)
        elif op == "qk_norm_rope":
            pairs = _qk_norm_rope_case(shape, dtype, device, gen)
        elif op in ("rope_kv", "qk_norm_rope_kv"):
            pairs = _writes_kv_case(op, shape, dtype, device, gen)
        elif op in ("silu", "gelu_tanh"):
            pairs = _act_case(op, shape, dtype, device, gen)
        else:
            pairs = _norm_case(op, shape, dtype, device, gen)
        results[name] = {}
        for key, (got, want) in pairs.items():
            assert got.shape == want.shape and got.dtype == want.dtype, (name, key)
            err = ((got.float() - want.float()).abs() / (want.float().abs() + 1)).max().item()
            results[name][key] = {"equal": torch.equal(got, want), "max_err": err}
    return results


def compile_for_sm90(dtype: str) -> dict[str, bool]:
    """Compile every kernel for an H100/H200 (sm_90) without a GPU, with the options the
    launches pass; per kernel, whether its PTX is free of FMAs (fp contraction is off)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from treadle.models import triton_ops as t

    common = {"IN_BITS": False}
    no_kv, kv = {"WRITE_KV": False, "BLOCK_SIZE": 1}, {"WRITE_KV": True, "BLOCK_SIZE": 16}
    kernels = [   # tiles as the launchers make them (_tile)
        (t._rms_norm_kernel, {**common, "D": 1024, "BLOCK": 1024, "ROWS": 2,
                              "UNIT_OFFSET": False}),
        (t._rms_norm_kernel, {**common, "D": 77, "BLOCK": 128, "ROWS": 16, "UNIT_OFFSET": True}),
        (t._fused_add_rms_norm_kernel, {**common, "D": 1024, "BLOCK": 1024, "ROWS": 2}),
        (t._act_and_mul_kernel, {**common, "I": 3072, "BLOCK": 1024, "ROWS": 2,
                                 "GELU_TANH": False}),
        (t._act_and_mul_kernel, {**common, "I": 37, "BLOCK": 64, "ROWS": 32, "GELU_TANH": True}),
        (t._rope_kernel, {**common, **no_kv, "HALF": 64, "HALF_PAD": 64, "Q_HEADS_PAD": 16,
                          "K_HEADS_PAD": 8, "TOKENS": 2}),
        (t._rope_kernel, {**common, **no_kv, "HALF": 18, "HALF_PAD": 32, "Q_HEADS_PAD": 8,
                          "K_HEADS_PAD": 2, "TOKENS": 8}),
        (t._rope_kernel, {**common, **kv, "HALF": 32, "HALF_PAD": 32, "Q_HEADS_PAD": 16,
                          "K_HEADS_PAD": 8, "TOKENS": 4}),
        (t._qk_norm_rope_kernel, {**common, **no_kv, "HALF": 64, "Q_HEADS_PAD": 16,
                                  "K_HEADS_PAD": 8, "TOKENS": 1}),
        (t._qk_norm_rope_kernel, {**common, **kv, "HALF": 64, "Q_HEADS_PAD": 16,
                                  "K_HEADS_PAD": 8, "TOKENS": 1}),
    ]
    fma_free = {}
    for i, (kernel, constants) in enumerate(kernels):
        signature = {}
        for name in kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name == "slot_ptr":
                signature[name] = "*i32"   # the backend's and the graphs' slot mapping
            elif name.endswith("_ptr"):
                signature[name] = f"*{dtype}"
            else:
                signature[name] = "fp32" if name == "eps" else "i32"
        compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constants),
                                  target=GPUTarget("cuda", 90, 32), options=t._LAUNCH)
        fma_free[f"{kernel.__name__}#{i}"] = re.search(r"\bfma\.", compiled.asm["ptx"]) is None
    return fma_free


def _in_fresh_python(calls: list[tuple[str, list]], interpret: bool) -> list:
    return in_fresh_python("tests.test_triton_ops", calls, interpret)


def _check(result: dict[str, dict], case: str, tol: float, interpreted: bool = True) -> None:
    op = CASES[case][0]
    if op == "gelu_tanh" and tol < GELU_FP32_TOL:
        tol = GELU_FP32_TOL
    for key, r in result.items():
        if key in (EXACT_INTERPRETED if interpreted else EXACT).get(op, ()):
            assert r["equal"], (case, key, r)
        assert r["max_err"] < tol, (case, key, r)


def test_what_the_in_place_ops_cannot_serve_is_refused_before_any_launch():
    """No kernel runs here (none could without a GPU or the interpreter): the checks come first."""
    from treadle.models import triton_ops

    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="must match"):
        triton_ops.fused_add_rms_norm(x, torch.zeros(3, 8, dtype=torch.bfloat16), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_ops.fused_add_rms_norm(x.t(), torch.zeros(8, 3), torch.ones(3), EPS)
    q, k, cos = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(3, 1, 16)
    with pytest.raises(ValueError, match="features must be contiguous"):
        triton_ops.rope_(q.transpose(1, 2), k, cos, cos)
    with pytest.raises(ValueError, match="be even and at most the head dim"):
        triton_ops.rope_(q, k, torch.zeros(3, 1, 18), torch.zeros(3, 1, 18))
    with pytest.raises(ValueError, match="the same tokens"):
        triton_ops.rope_(q, k[:2], cos, cos)
    half = torch.zeros(3, 1, 8)   # a partly rotary head: the norms and rope_ apart serve it
    with pytest.raises(ValueError, match="whole heads of a power-of-two size"):
        triton_ops.qk_norm_rope(q, k, torch.ones(16), torch.ones(16), EPS, half, half)
    with pytest.raises(ValueError, match="with the same tokens"):
        triton_ops.qk_norm_rope(q, k[:2], torch.ones(16), torch.ones(16), EPS, cos, cos)
    with pytest.raises(ValueError, match="share a dtype"):
        triton_ops.qk_norm_rope(q, k, torch.ones(16, dtype=torch.bfloat16), torch.ones(16), EPS,
                                cos, cos)
    # Writing K/V as RoPE makes them: heads rotated whole, into caches that fit them.
    from treadle.attention.backend import KVTarget

    cache = torch.zeros(2, 4, 4, 2, 16)
    target = (torch.zeros(3, 2, 16), KVTarget(cache[0], cache[1], torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="only for heads rotated whole: rotary dim 8, head dim 16"):
        triton_ops.rope_(q, k, half, half, target)
    wrong_heads = (torch.zeros(3, 2, 16), KVTarget(cache[0, :, :, :1], cache[1, :, :, :1],
                                                    target[1].slot_mapping))
    with pytest.raises(ValueError, match="caches \\[blocks, block size, kv heads, head dim\\]"):
        triton_ops.qk_norm_rope(q, k, torch.ones(16), torch.ones(16), EPS, cos, cos, wrong_heads)


# -- under the interpreter -------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted_ops() -> dict[str, dict]:
    """Every case in fp32 and in bf16: one interpreter process."""
    fp32, bf16 = _in_fresh_python([("compare_ops", ["float32", "cpu"]),
                                   ("compare_ops", ["bfloat16", "cpu"])], interpret=True)
    return {"float32": fp32, "bfloat16": bf16}


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_ops_match_torch_in_fp32(interpreted_ops, case):
    _check(interpreted_ops["float32"][case], case, FP32_TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_ops_match_torch_in_bf16(interpreted_ops, case):
    _check(interpreted_ops["bfloat16"][case], case, BF16_TOL)


def test_interpreted_bf16_rounds_to_nearest_even(interpreted_ops):
    """The interpreter alone truncates fp32 to bf16; rounded in bits (`_round`), the ops that
    round as torch does are equal to it in bf16, not merely close: SiLU-and-mul and the
    plain norms as well as RoPE and the residual."""
    bf16 = interpreted_ops["bfloat16"]
    for case in ("silu_two_blocks_1500", "silu_odd_37", "norm_odd_77", "rope_partial_d48"):
        assert bf16[case]["out"]["equal"], (case, bf16[case])


def test_the_gpu_benchmark_dry_runs_on_the_interpreter(tmp_path):
    """benchmarks/gpu/fused_ops.py as check.sh runs it, but on the CPU at one token and with
    no time for torch.compile: every op checked against eager and timed, compile skipped."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/fused_ops.py", "--device", "cpu",
                           "--budget-s", "0", "--tokens", "1", "--reps", "1",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ops = json.loads((tmp_path / "fused_ops.json").read_text())["ops"]
    few_rows = {"add_norm_qkv", "add_norm_gate_up", "silu_mul_down", "linear_o", "linear_head"}
    assert set(ops) == {"rms_norm", "add_rms_norm", "qk_head_norm", "silu_and_mul", "rope",
                        "qk_norm_rope", "write_kv", "qk_norm_rope_kv"} | few_rows
    for name, result in ops.items():
        row = result["1"]
        assert row["max_err_triton"] < BF16_TOL and row["eager_us"] > 0 and row["triton_us"] > 0, row
        # The few-row linears (triton_gemv.py) race the triton backend's path, not torch.compile.
        assert row.get("compile_us") == (None if name in few_rows else "skipped: out of time"), row
    assert proc.stderr.strip().splitlines()[-1].startswith("fastest over [1] tokens"), proc.stderr


# -- compiled for a GPU, without one ---------------------------------------------------------
def test_the_ops_compile_for_an_h100_without_fmas():
    """What the interpreter does not check: each kernel through Triton's compiler to sm_90
    code in fp32 and bf16, and no FMA in it, as the exact cases on a GPU need."""
    for fma_free in _in_fresh_python([("compile_for_sm90", ["fp32"]),
                                      ("compile_for_sm90", ["bf16"])], interpret=False):
        assert len(fma_free) == 10 and all(fma_free.values()), fma_free


# -- on a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_ops_match_torch_on_cuda(dtype):
    assert os.environ.get("TRITON_INTERPRET") != "1", "the GPU tests compile the kernels"
    results = compare_ops(dtype, "cuda")
    for case, result in results.items():
        _check(result, case, FP32_TOL_CUDA if dtype == "float32" else BF16_TOL, interpreted=False)
