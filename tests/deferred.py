"""Deferred steps on the CPU, as the in-process executor runs them on a GPU
(worker/deferred_step.py), and a record of what each step returned: the proof that they ran."""

from __future__ import annotations

from typing import Any

from treadle import LLM
from treadle.worker.deferred_step import DeferredStep


def defer_and_record(llm: LLM) -> list[Any]:
    """Turn the runner's deferred steps on; returns the list each step's result is added to."""
    runner = llm.engine.core.executor.worker.runner
    assert runner.allow_deferred_steps()
    results: list[Any] = []
    execute = runner.execute_model
    runner.execute_model = lambda so: results.append(execute(so)) or results[-1]
    return results


def num_deferred(results: list[Any]) -> int:
    return sum(isinstance(r, DeferredStep) for r in results)
