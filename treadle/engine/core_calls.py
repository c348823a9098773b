"""Reads and compound changes of an EngineCore that AsyncLLM runs between steps.

Module-level functions of the core, not closures, so that they reach an engine core in a
process of its own (engine/core_client.py) by name, as EngineCore's methods do.
"""

from __future__ import annotations

from typing import Any

from treadle.engine.core import EngineCore

WEIGHT_CHANGES = ("load_weights", "finish_weight_update")


def weight_version(core: EngineCore) -> Any:
    return core.weight_version


def is_asleep(core: EngineCore) -> bool:
    """As vLLM's is_sleeping: from sleep() until every part it put to sleep is woken."""
    return bool(core.asleep)


def labelled(core: EngineCore, change: str, *args: Any) -> tuple[int, Any]:
    """A weight change (`change`, one of WEIGHT_CHANGES) and the label it left, read in the
    same call: a change queued behind it cannot lend it its own label."""
    if change not in WEIGHT_CHANGES:
        raise ValueError(f"change must be load_weights or finish_weight_update, got {change!r}")
    return getattr(core, change)(*args), core.weight_version
