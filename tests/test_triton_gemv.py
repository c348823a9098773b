"""The few-row linears with their prologue fused (treadle/models/triton_gemv.py) against the
unfused path: the Triton norm or activation (triton_ops.py, itself held to torch in
test_triton_ops.py), then the product. On the CPU through Triton's interpreter, compiled to
H100 code without a GPU, and (`gpu`) on a CUDA device.

What must be exact: the new residual stream, and what reaches the product. The fused launch
and a plain gemv of the unfused op's output multiply in the same order, so their outputs are
equal bit for bit after SiLU-and-mul, and after the norm where it sums its squares in the
same order (interpreted, with K at most 512: one slice). Against torch's linear they differ by the product's order:
within an fp32 ulp or two, or a bf16 ulp.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fresh_python import in_fresh_python

EPS = 1e-6
FP32_TOL = 1e-5   # |got - ref| / (|ref| + 1), over sums of up to 600 products
BF16_TOL = 1e-2   # one bf16 rounding the other way
# (rows, out features, in features, bias): odd sizes leave masked tails in both directions.
CASES = [(1, 40, 64, False), (3, 37, 96, True), (4, 70, 600, False), (2, 19, 1100, True),
         (1, 9, 520, False)]


def compare(dtype: str, device: str) -> list[dict]:
    """Each case: the three ops' largest error against torch, and whether the fused launches
    equal a plain gemv of the unfused op's output (and the residual add_and_norm's)."""
    from treadle.models import triton_gemv, triton_ops
    from treadle.models.llama import RMSNorm

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    results = []
    for rows, n, k, has_bias in CASES:
        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

        # Row slices of wider buffers, each its own row stride: the kernel must read each
        # tensor by its own (a reviewer's find: reading the residual by x's passed).
        x, r = randn(rows, k + 3)[:, 1:k + 1], randn(rows, k + 8)[:, :k]
        gate_up = randn(rows, 2 * k + 5)[:, 2:2 * k + 2]
        w, bias = randn(n, k, scale=k ** -0.5), randn(n) if has_bias else None
        norm = RMSNorm(k, EPS).to(device=device, dtype=dt)
        norm.weight.data = randn(k)

        def error(got: torch.Tensor, inputs: torch.Tensor) -> float:
            want = torch.nn.functional.linear(inputs.float(), w.float(),
                                              bias.float() if bias is not None else None)
            return ((got.float() - want).abs() / (want.abs() + 1)).max().item()

        before = [x.clone(), r.clone(), gate_up.clone()]
        normed, new_residual = triton_ops.fused_add_rms_norm(x.clone(), r.clone(), norm.weight, EPS)
        fused, fused_residual = triton_gemv.add_norm_gemv(x, r, norm.weight, EPS, w, bias)
        act = triton_ops.silu_and_mul(gate_up)
        fused_act = triton_gemv.silu_mul_gemv(gate_up, w, bias)
        plain = triton_gemv.gemv(x, w, bias)
        results.append({
            "case": [rows, n, k, has_bias],
            "err": {"gemv": error(plain, x), "add_norm": error(fused, normed),
                    "silu_mul": error(fused_act, act)},
            "residual_equal": torch.equal(fused_residual, new_residual),
            "add_norm_equal": torch.equal(fused, triton_gemv.gemv(normed, w, bias)),
            "silu_mul_equal": torch.equal(fused_act, triton_gemv.gemv(act, w, bias)),
            "inputs_untouched": all(torch.equal(a, b) for a, b in zip(before, [x, r, gate_up]))})
    return results


def compile_for_sm90() -> list[int]:
    """Each kernel at Qwen3-0.6B's few-row shapes (qkv, gate/up, down, o, the LM head), one and
    four rows, compiled for an H100/H200 as the launcher would (16-byte aligned pointers and
    strides); the shared memory each takes."""
    import triton
    from triton.backends.compiler import GPUTarget

    from treadle.models import triton_gemv as g
    from treadle.models import triton_ops

    shapes = [(4096, 1024, g.ADD_NORM), (6144, 1024, g.ADD_NORM), (1024, 3072, g.SILU_MUL),
              (1024, 2048, g.PLAIN), (151936, 1024, g.PLAIN)]
    names = g._gemv_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name.startswith("stride_")}
    shared = []
    for n, k, prologue in shapes:
        block_n, block_k, warps = g.launch_shape(n, k)
        for rows in (1, 4):
            constants = {"K": k, "ROWS": rows, "BLOCK_N": block_n, "BLOCK_K": block_k,
                         "PROLOGUE": prologue, "HAS_BIAS": False, "IN_BITS": False}
            signature = {name: "constexpr" if name in constants else "*bf16" if name.endswith("_ptr")
                         else "fp32" if name == "eps" else "i32" for name in names}
            compiled = triton.compile(triton.compiler.ASTSource(g._gemv_kernel, signature,
                                                                constants, aligned),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={**triton_ops._LAUNCH, "num_warps": warps})
            shared.append(compiled.metadata.shared)
    return shared


def run_engine(path: str, prompts: list[list[int]], max_tokens: int, device_name: str,
               on_graph_buffers: bool) -> dict:
    """Greedy output of the engine on the triton backend in fp32 with the fused launches on
    (TREADLE_FEW_ROW_LINEARS=1): the prompts together (decodes of 3 rows), then each alone (1
    row), and how many layer steps took the fused launches. `on_graph_buffers`: every decode
    step on the CUDA graphs' persistent buffers, padded to 4 rows (run eagerly on the CPU,
    replayed on CUDA)."""
    from unittest import mock

    from tests.gpu import shared_gpu
    from tests.test_triton_attention import graph_buffers, together_and_alone
    from treadle import LLM
    from treadle.models import triton_gemv

    with mock.patch.dict(os.environ, {triton_gemv.ENV: "1"}), \
            mock.patch.object(triton_gemv, "silu_mul_gemv", wraps=triton_gemv.silu_mul_gemv) as fused, \
            mock.patch.object(triton_gemv, "gemv", wraps=triton_gemv.gemv) as o_proj, \
            LLM(path, device=device_name, attention_backend="triton", dtype="float32",
                block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                enforce_eager=not on_graph_buffers, **shared_gpu(device_name)) as llm:
        runner = llm.engine.core.executor.worker.runner
        layers = [layer for layer in runner.model.model.layers if layer.few_row_linears]
        if on_graph_buffers and device_name == "cpu":
            runner.graphs = graph_buffers(runner, 8)
        return {**together_and_alone(llm, prompts, max_tokens), "fused_layers": len(layers), "layers": len(runner.model.model.layers),
                "fused_steps": fused.call_count, "o_proj_steps": o_proj.call_count,
                "graph_steps": runner.graphs.num_steps if runner.graphs is not None else 0}


def _check(results: list[dict], tol: float, interpreted: bool = True) -> None:
    for r in results:
        assert r["residual_equal"] and r["silu_mul_equal"] and r["inputs_untouched"], r
        # The norm sums in one slice, in the interpreter's order; compiled, the two kernels'
        # layouts may sum in different orders.
        assert r["add_norm_equal"] or r["case"][2] > 512 or not interpreted, r
        assert max(r["err"].values()) < tol, r


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[dict]]:
    fp32, bf16 = in_fresh_python("tests.test_triton_gemv", [("compare", ["float32", "cpu"]),
                                                            ("compare", ["bfloat16", "cpu"])],
                                 interpret=True)
    return {"float32": fp32, "bfloat16": bf16}


def test_interpreted_fused_linears_match_the_unfused_path_in_fp32(interpreted):
    _check(interpreted["float32"], FP32_TOL)


def test_interpreted_fused_linears_match_the_unfused_path_in_bf16(interpreted):
    _check(interpreted["bfloat16"], BF16_TOL)


PROMPTS = [[11, 12, 13, 14, 15] * 5, list(range(500, 509)), [300 + 7 * i for i in range(20)]]


def test_interpreted_engine_with_the_fused_launches_matches_transformers(tiny_checkpoints,
                                                                         reference):
    """The tiny qwen2 (biases on q, k and v), every decode step on the decode graphs' buffers
    (the together run's 3 rows padded to 4), run eagerly under the interpreter."""
    path = tiny_checkpoints["qwen2"]
    result = in_fresh_python("tests.test_triton_gemv",
                             [("run_engine", [path, PROMPTS, 5, "cpu", True])], interpret=True)[0]
    want = [reference(path).greedy(p, 5) for p in PROMPTS]
    assert result["together"] == want and result["alone"] == want
    assert result["fused_layers"] == result["layers"]
    # Each layer but the first (no residual yet) of every decode step: 4 in each of the 3 runs
    # alone and the run together, at least; each a graph's step.
    assert result["fused_steps"] >= (result["layers"] - 1) * 4 * 4, result
    # o_proj by the plain product in the same steps, the first layer's included.
    assert result["o_proj_steps"] * (result["layers"] - 1) == result["fused_steps"] * result["layers"]
    assert result["graph_steps"] >= 4 * 4, result


def test_what_a_few_row_linear_cannot_take_is_refused_before_any_launch():
    from treadle.models import triton_gemv

    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"x \[1..4, 16\] .* got x \(5, 16\)"):
        triton_gemv.gemv(torch.zeros(5, 16), w)
    with pytest.raises(ValueError, match=r"got x \(2, 12\)"):
        triton_gemv.gemv(torch.zeros(2, 12), w)
    with pytest.raises(ValueError, match=r"x \[1..4, 32\] .* got x \(1, 16\)"):
        triton_gemv.silu_mul_gemv(torch.zeros(1, 16), w)
    with pytest.raises(ValueError, match="must match"):
        triton_gemv.add_norm_gemv(torch.zeros(1, 16), torch.zeros(2, 16), torch.ones(16), EPS, w)
    assert not triton_gemv.serves(5, w) and not triton_gemv.serves(1, w.t())
    assert triton_gemv.serves(4, w)


def test_the_kernels_compile_for_an_h100():
    shared = in_fresh_python("tests.test_triton_gemv", [("compile_for_sm90", [])],
                             interpret=False)[0]
    assert len(shared) == 10 and max(shared) <= 227 * 1024, shared


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("graphs", [False, True])
def test_the_engine_with_the_fused_launches_on_cuda_matches_transformers(tiny_checkpoints,
                                                                        reference, arch, graphs):
    result = run_engine(tiny_checkpoints[arch], PROMPTS, 5, "cuda", on_graph_buffers=graphs)
    want = [reference(tiny_checkpoints[arch]).greedy(p, 5) for p in PROMPTS]
    assert result["together"] == want and result["alone"] == want
    assert result["fused_layers"] == result["layers"]
    if not graphs:   # a graph's launches run at its capture, and replay without Python
        assert result["fused_steps"] >= (result["layers"] - 1) * 4 * 4, result
        assert (result["o_proj_steps"] * (result["layers"] - 1)
                == result["fused_steps"] * result["layers"]), result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_linears_match_the_unfused_path_on_cuda(dtype):
    _check(compare(dtype, "cuda"), FP32_TOL if dtype == "float32" else BF16_TOL, interpreted=False)
