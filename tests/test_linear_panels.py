"""The fp32 linear on AVX-512 panels (kernels/csrc/linear_panels.cpp) against a float64 GEMM,
and its use in the model: fp32 weights get panels where the CPU has AVX-512, through the same
calls as the bf16 tiles, and TILE_FROM_ROWS to PANEL_ROWS rows run on them. On a CPU without
AVX-512 the same tests hold the kernel to refusing."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import CPU, HAS_AVX512, needs_kernels
from tests.reference import linear_float64, refused_without
from treadle.models import linear


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 25, 48, 256])   # one block, whole and split ones
@pytest.mark.parametrize("out_features,in_features", [(32, 7), (96, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_panels_linear_matches_a_float64_gemm(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + in_features)
    w = torch.randn(out_features, in_features) / in_features ** 0.5
    x = torch.randn(rows, in_features)
    b = torch.randn(out_features) if bias else None
    if refused_without(HAS_AVX512, "tiles", w, "AVX-512"):
        return
    assert torch.ops.treadle.linear_tiles_ready(w)
    got = torch.ops.treadle.tiles_linear(x, torch.ops.treadle.pack_linear_tiles(w), b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    # fp32 fused multiply-adds in order over the inputs: a few fp32 ulps of the sum's scale
    torch.testing.assert_close(got.double(), linear_float64(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_panels_linear_takes_strided_rows_and_an_empty_batch():
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    if refused_without(HAS_AVX512, "tiles", w, "AVX-512"):
        return
    x = torch.randn(5, 200)[:, 10:74]   # rows a stride apart, as a slice of a fused tensor is
    packed = torch.ops.treadle.pack_linear_tiles(w)
    assert packed.shape == (2, 64, 32)
    torch.testing.assert_close(torch.ops.treadle.tiles_linear(x, packed, None).double(), linear_float64(x, w, None),
                               rtol=1e-5, atol=1e-5)
    assert torch.ops.treadle.tiles_linear(x[:0], packed, None).shape == (0, 64)


@needs_kernels
def test_panels_are_for_fp32_weights_of_whole_panels_with_avx512(monkeypatch):
    w = torch.randn(64, 40)
    assert torch.ops.treadle.linear_tiles_ready(w) == HAS_AVX512
    assert not torch.ops.treadle.linear_tiles_ready(w[:48].contiguous())   # outputs in 32s
    with pytest.raises(RuntimeError, match="N a multiple of 32"):
        torch.ops.treadle.pack_linear_tiles(w[:48].contiguous())
    monkeypatch.setenv("TREADLE_AMX", "0")   # AMX's switch: the panels need no tiles
    assert torch.ops.treadle.linear_tiles_ready(w) == HAS_AVX512
    packed = torch.ops.treadle.pack_linear_tiles(w)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the packed weight 40"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 32), packed, None)
    with pytest.raises(RuntimeError, match="bias: fp32"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 40), packed, torch.zeros(64).bfloat16())


@needs_kernels
def test_linear_routes_the_panel_kernels_rows(monkeypatch):
    """In fp32: only with panels and `native`, from TILE_FROM_ROWS to PANEL_ROWS rows; the
    few-row kernel keeps batch 1, oneDNN's GEMM the rest."""
    layer = linear.Linear(64, 64)
    linear.pack_weights(layer, CPU)
    calls = []
    kernel = torch.ops.treadle.tiles_linear
    monkeypatch.setattr(torch.ops.treadle, "tiles_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    counts = (1, linear.TILE_FROM_ROWS, linear.PANEL_ROWS, linear.PANEL_ROWS + 1)
    x = {n: torch.randn(n, 64) for n in counts}
    layer.native = True
    assert linear.pack_weight_tiles(layer) == int(HAS_AVX512)
    for n in counts:
        torch.testing.assert_close(layer(x[n]).double(), linear_float64(x[n], layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
    assert calls == ([linear.TILE_FROM_ROWS, linear.PANEL_ROWS] if HAS_AVX512 else [])
    if HAS_AVX512:
        assert linear.tile_rows(layer.tiles) == (linear.TILE_FROM_ROWS, linear.PANEL_ROWS)
