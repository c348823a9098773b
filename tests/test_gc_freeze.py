"""Start-up objects frozen out of the garbage collector's full collections (treadle/gc_freeze.py)
in processes that serve one engine for their whole life: worker processes here, the server in
test_server.py; an LLM in a user's process freezes it only while generate runs."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from treadle import LLM, SamplingParams


def frozen_objects(worker) -> int:
    """Given to collective_rpc: how many objects the worker's process froze."""
    return gc.get_freeze_count()


def plant_frozen_cycle(worker) -> bool:
    """Given to collective_rpc: a cycle holding a tensor, frozen, then dropped; the worker
    keeps a weak reference to the tensor (`frozen_cycle_alive`)."""
    import weakref

    import torch

    class Holder:
        pass

    a, b = Holder(), Holder()
    a.other, b.other = b, a
    a.tensor = torch.zeros(1024)
    worker.planted = weakref.ref(a.tensor)
    gc.freeze()
    del a, b
    gc.collect()
    return worker.planted() is not None   # frozen: the collection left it


def frozen_cycle_alive(worker) -> bool:
    return worker.planted() is not None


def test_a_worker_process_freezes_its_start_up_heap_and_an_llm_does_not(llama):
    with LLM(llama, distributed_executor_backend="mp", num_kv_blocks=64) as llm:
        [frozen] = llm.collective_rpc(frozen_objects)
        assert frozen > 10_000   # torch's modules and the model's, at least
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        # Sleep lets memory go: cycles among the frozen objects are collected too.
        assert llm.collective_rpc(plant_frozen_cycle) == [True]
        llm.sleep(level=1)
        assert llm.collective_rpc(frozen_cycle_alive) == [False]
        assert llm.collective_rpc(frozen_objects)[0] > 10_000   # and the rest frozen again
        llm.wake_up()
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    # This process may build and drop many engines: their cycles must stay collectable.
    with LLM(llama, num_kv_blocks=64) as llm:
        assert llm.collective_rpc(frozen_objects) == [0]


def test_an_llm_freezes_the_heap_only_while_generate_runs(llama):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM(llama, num_kv_blocks=64) as llm:
        step, seen = llm.engine.step, []

        def counting_step():
            seen.append(gc.get_freeze_count())
            return step()

        llm.engine.step = counting_step
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert len(seen) >= 4 and min(seen) > 10_000   # every step ran with the heap frozen
        assert gc.get_freeze_count() == 0              # and it was given back after

        def failing_step():
            raise KeyboardInterrupt

        llm.engine.step = failing_step
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        assert gc.get_freeze_count() == 0              # given back on the way out too

        # A freeze the user made is theirs: generate neither adds to it nor undoes it.
        llm.engine.step = counting_step
        seen.clear()
        gc.freeze()
        try:
            frozen = gc.get_freeze_count()
            llm.generate([{"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)
            assert gc.get_freeze_count() > frozen // 2 > 10_000
            assert max(seen) <= frozen
        finally:
            gc.unfreeze()


def test_generate_calls_in_a_loop_leave_no_garbage_for_good(llama, monkeypatch):
    """Each freeze sets the collector's counts to zero, and frozen garbage comes back in the
    oldest generation: without a collection of the young generations first, and of the whole
    heap once a minute, calls with little between them would keep a dropped cycle for good."""
    import time
    import weakref

    from treadle import gc_freeze

    class Node:
        pass

    params = SamplingParams(temperature=0.0, max_tokens=2)
    generations: list[int] = []

    def record(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    with LLM(llama, num_kv_blocks=64) as llm:
        for overdue in (False, True):
            # Both ways set here: the clock starts at import, and in a pytest worker that
            # imported treadle more than a minute ago the first call is overdue already.
            monkeypatch.setattr(gc_freeze, "_last_full_collection", time.monotonic() - (
                gc_freeze.FULL_COLLECTION_EVERY_S + 1 if overdue else 0))
            gc.collect()   # counts at zero: nothing collects by itself before the call
            node = Node()
            node.cycle = node
            alive = weakref.ref(node)
            del node
            generations.clear()
            gc.callbacks.append(record)
            try:
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
            finally:
                gc.callbacks.remove(record)
            assert alive() is None   # collected as the call began, not frozen and given back
            assert generations[0] == (2 if overdue else 1), generations
        assert time.monotonic() - gc_freeze._last_full_collection < 60


def test_freezing_leaves_later_cycles_collectable_and_unfreezes_at_exit():
    script = textwrap.dedent("""
        import atexit, gc
        import torch
        from treadle.gc_freeze import freeze_startup_heap

        # Registered first, so it runs last: after the unfreeze freeze_startup_heap registers.
        atexit.register(lambda: print("at exit, frozen:", gc.get_freeze_count()))
        freeze_startup_heap("a test")
        assert gc.get_freeze_count() > 10_000
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a   # a cycle made after the freeze
        del a, b
        assert gc.collect() >= 2
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["ok", "at exit, frozen: 0"]
