"""The C++ linear kernel for a few rows (decode at small batch) against torch's GEMM, and its
use in the model: below `linear.SMALL_ROWS` rows and only once the model uses the CPU kernels."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import CPU, needs_kernels
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
