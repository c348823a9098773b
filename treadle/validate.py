"""Checks of user-given values that several configs share, each raising ValueError that names
the field and the allowed range."""

from __future__ import annotations

from typing import Any


def check_seconds(name: str, value: Any, zero_ok: bool = False, zero_means: str = "") -> float:
    """`value` as a finite number of seconds, > 0 (or >= 0 with `zero_ok`; `zero_means` says
    what 0 does, for the message); a bool is not a number here."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 <= value < float("inf") or (value == 0 and not zero_ok)):
        bound = ">= 0" + (f" ({zero_means})" if zero_means else "") if zero_ok else "> 0"
        raise ValueError(f"{name} must be a number of seconds {bound}, got {value!r}")
    return float(value)
