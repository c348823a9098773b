"""treadle/validate.py: the shared check of a number of seconds, as every config uses it."""

from __future__ import annotations

import pytest

from treadle.validate import check_seconds


@pytest.mark.parametrize("value", [0.5, 3, 1e9])
def test_a_finite_positive_number_passes_as_a_float(value):
    assert check_seconds("x.timeout_s", value) == float(value)


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "1", None])
def test_anything_else_names_the_field_and_the_range(value):
    with pytest.raises(ValueError, match=r"^x\.timeout_s must be a number of seconds > 0, got "):
        check_seconds("x.timeout_s", value)


def test_zero_where_it_is_allowed_says_what_it_means():
    assert check_seconds("t", 0, zero_ok=True) == 0.0
    with pytest.raises(ValueError, match=r"t must be a number of seconds >= 0 \(0: no limit\), "
                                         r"got -1"):
        check_seconds("t", -1, zero_ok=True, zero_means="0: no limit")
