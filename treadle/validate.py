"""Checks of user-given values that several configs share, each raising ValueError that names
the field and the allowed range."""

from __future__ import annotations

import json
from typing import Any, Collection


def check_seconds(name: str, value: Any, zero_ok: bool = False, zero_means: str = "") -> float:
    """`value` as a finite number of seconds, > 0 (or >= 0 with `zero_ok`; `zero_means` says
    what 0 does, for the message); a bool is not a number here."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 <= value < float("inf") or (value == 0 and not zero_ok)):
        bound = ">= 0" + (f" ({zero_means})" if zero_means else "") if zero_ok else "> 0"
        raise ValueError(f"{name} must be a number of seconds {bound}, got {value!r}")
    return float(value)


def json_dict(name: str, spec: dict[str, Any] | str, known: Collection[str] | None = None,
              kind: str = "a dict") -> dict[str, Any]:
    """A dict argument, or its JSON (from the command line); with `known`, no key outside it.
    `kind`: what the message calls a dict ("a JSON object" for a flag that takes only JSON)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be {kind}, got {type(spec).__name__}")
    unknown = set(spec) - set(known) if known is not None else set()
    if unknown:
        raise ValueError(f"{name} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return spec


# Objects and lists within objects and lists, at most: pydantic-core serializes about 255
# levels, and chat templates and json recurse a few frames a level toward Python's limit.
MAX_NESTING = 128


def too_deep(value: Any, limit: int = MAX_NESTING) -> str | None:
    """The top-level key (or index) under which decoded JSON nests more than `limit` objects
    and lists deep, or None. Iterative, so that no depth reaches Python's recursion limit; a
    list holding no container (token ids) is passed over in one C call."""
    if not isinstance(value, (dict, list)):
        return None
    stack = [(item, key, 1) for key, item in (value.items() if isinstance(value, dict)
                                              else enumerate(value))
             if isinstance(item, (dict, list))]
    while stack:
        item, top, depth = stack.pop()
        if depth > limit:
            return str(top)
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, list) and not {dict, list} & set(map(type, item)):
            continue
        stack.extend((child, top, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return None
