"""The bf16 tile entry points (kernels/csrc/linear_tiles.cpp) against a float64 GEMM, and their
use in the model: bf16 weights get AMX tiles where the CPU has AMX, else panels of bf16 pairs
where it has AVX512-BF16 (linear_pairs.cpp, tests/test_linear_pairs.py), and decode steps of
the rows linear.tile_rows() gives run on them. On a CPU with neither the same tests
hold the kernel to refusing, so they run, and mean something, on every kind of machine."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import CPU, HAS_AMX, HAS_PAIRS, needs_kernels
from tests.reference import linear_float64, refused_without
from treadle.models import linear

HAS_TILES = HAS_AMX or HAS_PAIRS


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 64, 96, 300])   # whole and partial row blocks
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (96, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_linear_matches_a_float64_gemm(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + in_features)
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    if refused_without(HAS_TILES, "tiles", w, "AMX"):
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
    if refused_without(HAS_TILES, "tiles", w, "AMX"):
        return
    wide = torch.randn(5, 200).bfloat16()
    x = wide[:, 10:74]   # rows a stride apart, as a slice of a fused tensor is
    packed = torch.ops.treadle.pack_linear_tiles(w)
    torch.testing.assert_close(torch.ops.treadle.tiles_linear(x, packed, None).double(), linear_float64(x, w, None),
                               rtol=2 ** -7, atol=1e-3)
    assert torch.ops.treadle.tiles_linear(x[:0], packed, None).shape == (0, 64)


@needs_kernels
def test_bf16_weights_get_amx_tiles_else_pairs(monkeypatch):
    w = torch.randn(64, 64).bfloat16()
    assert torch.ops.treadle.linear_tiles_ready(w) == HAS_TILES
    if HAS_TILES:
        assert linear.pack_tiles(w).dim() == (4 if HAS_AMX else 3)   # the copy's rank names its kernel
    assert not torch.ops.treadle.linear_tiles_ready(w.double())          # bf16 (fp32: panels)
    assert not torch.ops.treadle.linear_tiles_ready(w[:48].contiguous())  # outputs in 32s, for both
    # inputs: AMX tiles take whole 32s, pairs any even count
    assert torch.ops.treadle.linear_tiles_ready(w[:, :48].contiguous()) == HAS_PAIRS
    assert not torch.ops.treadle.linear_tiles_ready(w[:, :47].contiguous())
    assert linear.pack_tiles(w.double()) is None
    monkeypatch.setenv("TREADLE_AMX", "0")   # AMX's switch: pairs need no tiles
    assert torch.ops.treadle.linear_tiles_ready(w) == HAS_PAIRS
    assert (linear.pack_tiles(w).dim() == 3) if HAS_PAIRS else (linear.pack_tiles(w) is None)


@needs_kernels
def test_tiles_linear_refuses_what_it_cannot_take():
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match="N a multiple of 32"):
        torch.ops.treadle.pack_linear_tiles(w[:48].contiguous())
    with pytest.raises(RuntimeError, match="a bf16"):
        torch.ops.treadle.pack_linear_tiles(w.double())
    packed = torch.ops.treadle.pack_linear_tiles(w)   # AMX's layout needs no AMX to pack
    assert packed.shape == ((2, 32, 64) if HAS_PAIRS and not HAS_AMX else (4, 2, 16, 32))
    with pytest.raises(RuntimeError, match="x has 32 inputs, the packed weight 64"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 32).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 64).bfloat16(), packed, torch.zeros(64))
    with pytest.raises(RuntimeError, match="x: bf16"):
        torch.ops.treadle.tiles_linear(torch.zeros(2, 64).double(), packed, None)


@needs_kernels
def test_linear_routes_the_tile_kernels_rows(monkeypatch):
    """Only with tiles and `native`, only over the rows tile_rows() gives: TILE_FROM_ROWS to
    TILE_ROWS on AMX tiles (the few-row kernel keeps batch 1), 1 to PAIR_ROWS on pairs;
    oneDNN's GEMM the rest."""
    layer = linear.Linear(64, 64).bfloat16()
    linear.pack_weights(layer, CPU)
    calls = []
    kernel = torch.ops.treadle.tiles_linear
    monkeypatch.setattr(torch.ops.treadle, "tiles_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    layer.native = True
    assert linear.pack_weight_tiles(layer) == int(HAS_TILES)
    first, last = (linear.TILE_FROM_ROWS, linear.TILE_ROWS) if HAS_AMX else (1, linear.PAIR_ROWS)
    if HAS_TILES:
        assert linear.tile_rows(layer.tiles) == (first, last)
    counts = (1, linear.TILE_FROM_ROWS, last, last + 1)
    x = {n: torch.randn(n, 64).bfloat16() for n in counts}
    for n in counts:
        torch.testing.assert_close(layer(x[n]).double(), linear_float64(x[n], layer.weight, layer.bias),
                                   rtol=2 ** -7, atol=1e-3)
    assert calls == ([n for n in counts if first <= n <= last] if HAS_TILES else [])
    assert calls[-1:] == ([last] if HAS_TILES else [])
    layer.native = False   # the Python path without the kernels never takes them
    calls.clear()
    for n in counts:
        layer(x[n])
    assert calls == []
