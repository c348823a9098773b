"""Deferred steps on the CPU, as the in-process executor runs them on a GPU
(worker/deferred_step.py), and a record of what each step returned: the proof that they ran."""

from __future__ import annotations

from typing import Any

import pytest

from treadle import LLM
from treadle.structured_output.reasoning import AfterReasoning
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


def record_waits(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, set[str]]]:
    """Turn deferred steps on; returns a list that gets, for each step queued behind one whose
    tokens its rows read, whether it waited for them first, and what grammars those rows had
    when the step began: "matcher", "waiting" (for the end of the reasoning) or "free"."""
    runner = llm.engine.core.executor.worker.runner
    assert runner.allow_deferred_steps()
    waits: list[tuple[bool, set[str]]] = []
    kinds: dict[int, str] = {}   # slot: its grammar's kind as the last step ended

    def kind(grammar) -> str:
        return "free" if grammar is None else "waiting" if isinstance(grammar, AfterReasoning) else "matcher"

    execute = runner.execute_model

    def execute_and_look(so):
        out = execute(so)
        kinds.clear()
        kinds.update({s: kind(g) for s, g in enumerate(runner.slots.grammar)})
        return out

    queue = DeferredStep.queue.__func__

    def queue_and_record(cls, sampler, slots, grammars, logits, req_ids, idx, rows, ends, prompt,
                         previous):
        if previous is not None:
            reading = set(idx[rows].tolist()) & (set(previous.slots.tolist()) - previous.dropped)
            if reading:
                waits.append((previous.output is not None, {kinds[s] for s in reading}))
        return queue(cls, sampler, slots, grammars, logits, req_ids, idx, rows, ends, prompt,
                     previous)

    runner.execute_model = execute_and_look
    monkeypatch.setattr(DeferredStep, "queue", classmethod(queue_and_record))
    return waits


def record_deferred(runner) -> list[bool]:
    """Wrap the runner's execute_model, deferral left as it is; returns the list that gets, for
    each step, whether it was deferred (booleans: a step's output is not kept alive)."""
    deferred: list[bool] = []
    execute = runner.execute_model

    def recorded(so):
        out = execute(so)
        deferred.append(isinstance(out, DeferredStep))
        return out

    runner.execute_model = recorded
    return deferred


def defer_and_count(worker) -> bool:
    """Given to collective_rpc (a worker process's runner, executor/mp.py): the runner defers
    its steps, as on a GPU, and the worker counts the steps it deferred (`worker_num_deferred`)."""
    worker.deferred = record_deferred(worker.runner)
    return worker.runner.allow_deferred_steps()


def worker_num_deferred(worker) -> int:
    """Given to collective_rpc after `defer_and_count`: the steps the worker deferred."""
    return sum(worker.deferred)
