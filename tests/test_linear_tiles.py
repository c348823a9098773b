"""The bf16 linear on AMX tiles (kernels/csrc/linear_tiles.cpp) against a float64 GEMM, and its
use in the model: bf16 weights get tiles only where the CPU has AMX, and decode steps of
TILE_FROM_ROWS to TILE_ROWS rows run on them. On a CPU without AMX the same tests hold the
kernel to refusing, so they run, and mean something, on either kind of machine."""

from __future__ import annotations

import pytest
import torch

from tests.reference import linear_float64, refused_without
from treadle.kernels import cpu
from treadle.kernels.cpu import cpu_kernels_available
from treadle.models import linear

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_kernels_available(CPU), reason="no C++ compiler here")
HAS_AMX = cpu.cpu_has(*cpu.AMX_FLAGS)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 64, 96, 300])   # whole and partial row blocks
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (96, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_linear_matches_a_float64_gemm(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + in_features)
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    if refused_without(HAS_AMX, "tiles", w, "AMX"):
        return
    assert torch.ops.treadle.linear_tiles_ready(w)
    got = torch.ops.treadle.tiles_linear(x, torch.ops.treadle.pack_linear_tiles(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    want = linear_float64(x, w, b)
    # fp32 sums of exact bf16 products, rounded once to bf16: within an ulp of bf16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-3)


@needs_kernels
def test_tiles_linear_takes_strided_rows_and_an_empty_batch():
    torch.manual_seed(0)
    w = torch.randn(64, 64).bfloat16()
    if refused_without(HAS_AMX, "tiles", w, "AMX"):
        return
    wide = torch.randn(5, 200).bfloat16()
    x = wide[:, 10:74]   # rows a stride apart, as a slice of a fused tensor is
    packed = torch.ops.treadle.pack_linear_tiles(w)
    torch.testing.assert_close(torch.ops.treadle.tiles_linear(x, packed, None).double(), linear_float64(x, w, None),
                               rtol=2 ** -7, atol=1e-3)
    assert torch.ops.treadle.tiles_linear(x[:0], packed, None).shape == (0, 64)


@needs_kernels
def test_tiles_are_for_bf16_weights_of_whole_tiles_on_amx(monkeypatch):
    w = torch.randn(64, 64).bfloat16()
    assert torch.ops.treadle.linear_tiles_ready(w) == HAS_AMX
    assert not torch.ops.treadle.linear_tiles_ready(w.double())          # bf16 (fp32: panels)
    assert not torch.ops.treadle.linear_tiles_ready(w[:48].contiguous())  # outputs in pairs of 16
    assert not torch.ops.treadle.linear_tiles_ready(w[:, :48].contiguous())  # inputs in 32s
    assert linear.pack_tiles(w.double()) is None
    monkeypatch.setenv("TREADLE_AMX", "0")
    assert not torch.ops.treadle.linear_tiles_ready(w)
    assert linear.pack_tiles(w) is None


@needs_kernels
def test_tiles_linear_refuses_what_it_cannot_take():
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match="N a multiple of 32"):
        torch.ops.treadle.pack_linear_tiles(w[:48].contiguous())
    with pytest.raises(RuntimeError, match="a bf16"):
        torch.ops.treadle.pack_linear_tiles(w.double())
    packed = torch.ops.treadle.pack_linear_tiles(w)   # packing needs no AMX, only the layout
    assert packed.shape == (4, 2, 16, 32)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the packed weight 64"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 32).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 64).bfloat16(), packed, torch.zeros(64))
    with pytest.raises(RuntimeError, match="x: bf16"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 64).double(), packed, None)


@needs_kernels
def test_linear_routes_the_tile_kernels_rows(monkeypatch):
    """Only with tiles and `native`, only from TILE_FROM_ROWS to TILE_ROWS rows; the few-row
    kernel keeps batch 1, oneDNN's GEMM the rest."""
    layer = linear.Linear(64, 64).bfloat16()
    linear.pack_weights(layer, CPU)
    calls = []
    kernel = torch.ops.treadle.tiles_linear
    monkeypatch.setattr(torch.ops.treadle, "tiles_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    counts = (1, linear.TILE_FROM_ROWS, linear.TILE_ROWS, linear.TILE_ROWS + 1)
    x = {n: torch.randn(n, 64).bfloat16() for n in counts}
    layer.native = True
    assert linear.pack_weight_tiles(layer) == int(HAS_AMX)
    for n in counts:
        torch.testing.assert_close(layer(x[n]).double(), linear_float64(x[n], layer.weight, layer.bias),
                                   rtol=2 ** -7, atol=1e-3)
    assert calls == ([linear.TILE_FROM_ROWS, linear.TILE_ROWS] if HAS_AMX else [])
    layer.native = False   # the Python path without the kernels never takes them
    calls.clear()
    for n in counts:
        layer(x[n])
    assert calls == []
