"""The C++ linear kernel for a few rows (decode at small batch) against torch's GEMM, and its
use in the model: below `linear.SMALL_ROWS` rows and only once the model uses the CPU kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernel_support import CPU, HAS_AVX512, needs_kernels
from treadle.kernels import cpu
from tests.reference import linear_float64
from treadle.models import linear


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("in_features", [576, 100])   # a multiple of the vector width, and not
@pytest.mark.parametrize("bias", [False, True])
def test_small_rows_linear_matches_torch_fp32(rows, in_features, bias):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    w = torch.randn(300, in_features)
    b = torch.randn(300) if bias else None
    expected = linear_float64(x, w, b).float()
    torch.testing.assert_close(torch.ops.treadle.small_rows_linear(x, w, b), expected,
                               rtol=1e-5, atol=1e-4)


@needs_kernels
def test_small_rows_linear_bf16_and_a_strided_x():
    torch.manual_seed(0)
    wide = torch.randn(2, 1000, dtype=torch.bfloat16)
    x = wide[:, :576]   # rows a stride apart, as a slice of a fused tensor is
    w = torch.randn(64, 576, dtype=torch.bfloat16)
    got = torch.ops.treadle.small_rows_linear(x, w, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-1)


def sixteen_lane_order(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x @ w.T + b in fp32 as the vector kernels add it, K a multiple of 16: per output, 16
    lane sums, those lanes reduced as GCC's _mm512_reduce_add_ps does (halves, quarters,
    pairs), then the bias. (Weights past the last whole vector are added in an order of the
    compiler's: the same code on either CPU.)"""
    lanes = np.zeros((x.shape[0], w.shape[0], 16), np.float32)
    for i in range(0, x.shape[1], 16):
        lanes = lanes + x[:, None, i:i + 16] * w[None, :, i:i + 16]
    halves = lanes[..., 8:] + lanes[..., :8]
    quarters = halves[..., 4:] + halves[..., :4]
    pairs = quarters + quarters[..., [2, 3, 0, 1]]
    return (pairs[..., 0] + pairs[..., 1]) + b


@needs_kernels
@pytest.mark.skipif(not (HAS_AVX512 or cpu.cpu_has("avx2")),
                    reason="the plain loop, for CPUs with neither AVX2 nor AVX-512, sums in "
                           "another order")
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_avx2_and_avx512_add_in_one_order_at_every_batch(rows):
    """The AVX2 kernel keeps the AVX-512 kernel's 16-lane sums, so an output's bits do not
    depend on the CPU (with either), nor on how many rows share the call."""
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 576), torch.randn(37, 576), torch.randn(37)   # 37: columns
    got = torch.ops.treadle.small_rows_linear(x, w, b)                          # past the streams
    assert np.array_equal(got.numpy(), sixteen_lane_order(x.numpy(), w.numpy(), b.numpy()))
    x, w = torch.randn(rows, 100), torch.randn(37, 100)   # 4 weights past the last vector
    got = torch.ops.treadle.small_rows_linear(x, w, b)
    for r in range(rows):
        assert torch.equal(torch.ops.treadle.small_rows_linear(x[r:r + 1], w, b), got[r:r + 1])


@needs_kernels
def test_small_rows_linear_refuses_what_it_cannot_take():
    w = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="at most"):
        torch.ops.treadle.small_rows_linear(torch.randn(9, 32), w, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.treadle.small_rows_linear(torch.randn(1, 32, dtype=torch.bfloat16), w, None)


@needs_kernels
def test_linear_routes_only_few_rows_to_the_kernel(monkeypatch):
    layer = linear.Linear(64, 48)
    linear.pack_weights(layer, CPU)
    calls = []
    kernel = torch.ops.treadle.small_rows_linear
    monkeypatch.setattr(linear, "_small_rows_linear",
                        lambda *a: calls.append(a[0].shape[0]) or kernel(*a), raising=False)
    expected = {n: torch.nn.functional.linear(torch.ones(n, 64), layer.weight, layer.bias)
                for n in (1, linear.SMALL_ROWS, linear.SMALL_ROWS + 1)}
    for native in (False, True):
        layer.native = native
        for n, want in expected.items():
            torch.testing.assert_close(layer(torch.ones(n, 64)), want, rtol=1e-5, atol=1e-5)
    assert calls == [1, linear.SMALL_ROWS]   # native only, and only up to SMALL_ROWS rows
