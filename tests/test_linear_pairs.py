"""The bf16 linear from AVX512-BF16 pairs (kernels/csrc/linear_pairs.cpp) against a float64
GEMM, called directly: the tile entry points hand bf16 weights to it on CPUs without AMX
(tests/test_linear_tiles.py holds that routing). On a CPU without AVX512-BF16 the same tests
hold the kernel to refusing."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import HAS_PAIRS, needs_kernels
from tests.reference import linear_float64, refused_without


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 25, 64, 300])   # whole and uneven blocks of 12
@pytest.mark.parametrize("out_features,in_features", [(32, 2), (64, 34), (96, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_pairs_linear_matches_a_float64_gemm(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + in_features)
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    if refused_without(HAS_PAIRS, "pairs", w, "AVX512-BF16"):
        return
    assert torch.ops.treadle.linear_pairs_ready(w)
    got = torch.ops.treadle.pairs_linear(x, torch.ops.treadle.pack_linear_pairs(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # fp32 sums of exact bf16 products, rounded once to bf16: within an ulp of bf16
    torch.testing.assert_close(got.double(), linear_float64(x, w, b), rtol=2 ** -7, atol=1e-3)


@needs_kernels
def test_pairs_linear_takes_strided_rows_and_an_empty_batch():
    torch.manual_seed(0)
    w = torch.randn(64, 64).bfloat16()
    if refused_without(HAS_PAIRS, "pairs", w, "AVX512-BF16"):
        return
    x = torch.randn(5, 200).bfloat16()[:, 10:74]   # rows a stride apart, as a slice of a fused tensor is
    packed = torch.ops.treadle.pack_linear_pairs(w)
    torch.testing.assert_close(torch.ops.treadle.pairs_linear(x, packed, None).double(), linear_float64(x, w, None),
                               rtol=2 ** -7, atol=1e-3)
    assert torch.ops.treadle.pairs_linear(x[:0], packed, None).shape == (0, 64)


@needs_kernels
def test_pairs_pack_each_pair_of_inputs_beside_its_panels_outputs():
    w = torch.arange(64 * 4, dtype=torch.float32).view(64, 4).bfloat16()
    packed = torch.ops.treadle.pack_linear_pairs(w)   # packing needs no AVX512-BF16, only the layout
    assert packed.shape == (2, 2, 64)
    # panel 1, inputs 2 and 3: output 32 + o's pair at 2 * o
    assert packed[1, 1, 2 * 5:2 * 5 + 2].tolist() == w[37, 2:4].tolist()


@needs_kernels
def test_pairs_linear_refuses_what_it_cannot_take():
    w = torch.randn(64, 64).bfloat16()
    assert not torch.ops.treadle.linear_pairs_ready(w[:48].contiguous())
    assert not torch.ops.treadle.linear_pairs_ready(w[:, :63].contiguous())
    assert not torch.ops.treadle.linear_pairs_ready(w.float())
    with pytest.raises(RuntimeError, match="N a multiple of 32 and K even"):
        torch.ops.treadle.pack_linear_pairs(w[:, :63].contiguous())
    with pytest.raises(RuntimeError, match="a bf16"):
        torch.ops.treadle.pack_linear_pairs(w.float())
    packed = torch.ops.treadle.pack_linear_pairs(w)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the packed weight 64"):
        torch.ops.treadle.pairs_linear(torch.zeros(2, 32).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias: bf16"):
        torch.ops.treadle.pairs_linear(torch.zeros(2, 64).bfloat16(), packed, torch.zeros(64))
    with pytest.raises(RuntimeError, match="x: bf16"):
        torch.ops.treadle.pairs_linear(torch.zeros(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="packed: from pack_linear_pairs"):
        torch.ops.treadle.pairs_linear(torch.zeros(2, 64).bfloat16(), w, None)
