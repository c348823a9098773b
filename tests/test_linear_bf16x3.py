"""fp32 linear layers on AMX tiles over three bf16 parts of each value
(kernels/csrc/linear_bf16x3.cpp): as precise as an fp32 GEMM against a float64 one, serving
the rows past the panels' (linear.PANEL_ROWS) where the CPU has AMX, in the Python layers and
in the layer stack alike, and greedy output still equal to transformers' through it. On a CPU
without AMX the same tests hold the kernel to refusing."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import CPU, HAS_AMX, needs_kernels
from tests.reference import linear_float64, refused_without
from treadle import LLM, SamplingParams
from treadle.models import linear


@needs_kernels
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 129, 300])   # whole, partial and odd row blocks
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (96, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16x3_linear_is_as_precise_as_an_fp32_gemm(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + in_features)
    w = torch.randn(out_features, in_features) / in_features ** 0.5
    x = torch.randn(rows, in_features)
    b = torch.randn(out_features) if bias else None
    if refused_without(HAS_AMX, "bf16x3", w, "AMX"):
        return
    assert torch.ops.treadle.linear_bf16x3_ready(w)
    got = torch.ops.treadle.bf16x3_linear(x, torch.ops.treadle.pack_linear_bf16x3(w), b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = linear_float64(x, w, b)
    error = (got.double() - exact).abs().max().item()
    # against the fp32 GEMM it stands in for: oneDNN's, on its packed weight
    onednn_error = (linear.linear(x, w, b, linear.pack(w)).double() - exact).abs().max().item()
    # One bf16 part alone would be off by about 1e-2 here; all six products by an fp32 GEMM's
    # few ulps (it sums 6 terms per input into one accumulator, so somewhat more roundings).
    assert error <= 2 * onednn_error + 1e-6, (error, onednn_error)


@needs_kernels
def test_bf16x3_linear_takes_strided_rows_and_an_empty_batch():
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    if refused_without(HAS_AMX, "bf16x3", w, "AMX"):
        return
    x = torch.randn(150, 200)[:, 10:74]   # rows a stride apart, as a slice of a fused tensor is
    packed = torch.ops.treadle.pack_linear_bf16x3(w)
    assert packed.shape == (4, 2, 3, 16, 32) and packed.dtype == torch.bfloat16
    torch.testing.assert_close(torch.ops.treadle.bf16x3_linear(x, packed, None).double(), linear_float64(x, w, None),
                               rtol=1e-5, atol=1e-5)
    assert torch.ops.treadle.bf16x3_linear(x[:0], packed, None).shape == (0, 64)


@needs_kernels
def test_bf16x3_is_for_fp32_weights_of_whole_tiles_on_amx(monkeypatch):
    w = torch.randn(64, 64)
    assert torch.ops.treadle.linear_bf16x3_ready(w) == HAS_AMX
    assert not torch.ops.treadle.linear_bf16x3_ready(w.bfloat16())
    assert not torch.ops.treadle.linear_bf16x3_ready(w[:48].contiguous())   # outputs in 32s
    assert not torch.ops.treadle.linear_bf16x3_ready(w[:, :40].contiguous())   # inputs in 32s
    with pytest.raises(RuntimeError, match="N a multiple of 32 and K of 32"):
        torch.ops.treadle.pack_linear_bf16x3(w[:, :40].contiguous())
    packed = torch.ops.treadle.pack_linear_bf16x3(w)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the packed weight 64"):
        torch.ops.treadle.bf16x3_linear(torch.zeros(2, 32), packed, None)
    with pytest.raises(RuntimeError, match="bias: fp32"):
        torch.ops.treadle.bf16x3_linear(torch.zeros(2, 64), packed, torch.zeros(64).bfloat16())
    with pytest.raises(RuntimeError, match="from pack_linear_bf16x3"):
        torch.ops.treadle.bf16x3_linear(torch.zeros(2, 64), packed[:1], None)
    monkeypatch.setenv("TREADLE_AMX", "0")   # the switch that keeps the vector kernels
    assert not torch.ops.treadle.linear_bf16x3_ready(w)
    with pytest.raises(RuntimeError, match="may not use AMX tiles" if HAS_AMX else "AMX"):
        torch.ops.treadle.bf16x3_linear(torch.zeros(2, 64), packed, None)


@needs_kernels
def test_linear_routes_rows_past_the_panels_to_bf16x3(monkeypatch):
    """A `native` fp32 layer with AMX: the panels to PANEL_ROWS, bf16x3 past them, and no
    oneDNN copy, since nothing would run it; without AMX oneDNN keeps those rows."""
    layer = linear.Linear(64, 64)
    layer.native = True
    linear.pack_weights(layer, CPU)
    assert (layer.packed is None) == HAS_AMX
    linear.pack_weight_tiles(layer)
    assert (layer.bf16x3 is not None) == HAS_AMX
    calls = []
    kernel = torch.ops.treadle.bf16x3_linear
    monkeypatch.setattr(torch.ops.treadle, "bf16x3_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for n in (1, linear.TILE_FROM_ROWS, linear.PANEL_ROWS, linear.PANEL_ROWS + 1, 3000):
        x = torch.randn(n, 64)
        torch.testing.assert_close(layer(x).double(), linear_float64(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
    assert calls == ([linear.PANEL_ROWS + 1, 3000] if HAS_AMX else [])
    warmed = linear.warm_up_gemms(layer, 512, 512)
    assert warmed == 0 if HAS_AMX else warmed > 0
    linear.unpack_weights(layer)
    assert layer.bf16x3 is None


@needs_kernels
def test_long_prompts_through_bf16x3_match_transformers_with_and_without_the_stack(tiny_checkpoints, reference):
    """Prefill steps of hundreds of rows in fp32: the layer stack and the Python layers agree
    bit for bit (tokens and logprobs), and greedy tokens equal transformers'."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, max_num_batched_tokens=512, enable_prefix_caching=False)
    model = llm.engine.core.executor.worker.runner.model
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate((300, 180, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    try:
        assert (model.model.layers[0].mlp.gate_up_proj.bf16x3 is not None) == HAS_AMX
        with_stack = run()
        stack, model.layer_stack = model.layer_stack, None
        assert stack is not None
        assert run() == with_stack
        model.layer_stack = stack
        ref = reference(path)
        assert [tokens for tokens, _ in with_stack] == [ref.greedy(p, 8) for p in prompts]
    finally:
        llm.shutdown()
