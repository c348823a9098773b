"""The `ray` executor on a real Ray cluster started here: two nodes on this machine, a head and
a second one with a resource of its own (ray.cluster_utils.Cluster), so that a stage can be
pinned to each. Checked token by token against transformers, and through the deaths of a worker
and of a whole node.

One cluster serves the whole module (it takes seconds to start); the test that kills the second
node runs last. Each test checks that its workers are gone, and the module that nothing of Ray
outlives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from tests.reference import HFReference
from tests.test_correctness import TEXTS
from tests.test_gc_freeze import frozen_objects
from tests.test_parallel import TINY_ARGS, assert_exact, children, greedy, running, token_ids
from treadle import LLM, AsyncLLM, EngineDeadError
from treadle.executor.ray import BUNDLES_ENV
from treadle.models.loader import iter_hf_weights

RAY = {"distributed_executor_backend": "ray"}


@pytest.fixture(scope="module")
def cluster():
    """A head (4 logical CPUs, resource "head") and a second node (2 CPUs, resource "second"),
    with node deaths noticed in about two seconds rather than Ray's default of fifteen."""
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 4, "resources": {"head": 4}, "include_dashboard": False,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                           "health_check_timeout_ms": 1000, "health_check_failure_threshold": 2}})
    second = cluster.add_node(num_cpus=2, resources={"second": 2})
    cluster.wait_for_nodes()
    try:
        yield cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()
        deadline = time.monotonic() + 20
        while children() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = children()
        for p in left:
            p.kill()
        assert not left, f"Ray processes left running: {[p.cmdline() for p in left]}"


def pid_of(worker) -> int:
    return os.getpid()


def refuse(worker, why: str) -> None:
    raise ValueError(why)


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in pids), "workers outlived their engine"


# -- without Ray --------------------------------------------------------------------------------
def test_without_ray_the_error_says_how_to_install_it(tiny_checkpoints):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ray"] = None   # as if Ray were not installed
        from treadle import LLM
        try:
            LLM({tiny_checkpoints["llama"]!r}, pipeline_parallel_size=2,
                distributed_executor_backend="ray")
        except ImportError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "pip install 'treadle[ray]'" in out.stdout, out.stdout + out.stderr


# -- exactness and the controls ------------------------------------------------------------------
def test_two_stages_match_transformers_with_every_control(cluster, tiny_checkpoints, reference):
    """PP=2 with async scheduling, chunks of 16 tokens and preemptions: exact. Then the controls
    reach every rank as with `mp`: collective_rpc by name and by callable, a caller's error
    raised as its own type with the workers fine, pause/resume, a weight update and sleep/wake."""
    path = tiny_checkpoints["llama"]
    prompts = token_ids(path) + [token_ids(path, [TEXTS[3] * 3])[0][:120]]
    with LLM(path, pipeline_parallel_size=2, async_scheduling=True, **RAY, **TINY_ARGS) as llm:
        executor = llm.engine.core.executor
        pids = llm.collective_rpc(pid_of)
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert executor.failure() is None
        # Each actor froze its start-up objects out of full collections (treadle/gc_freeze.py).
        assert all(n > 10_000 for n in llm.collective_rpc(frozen_objects))
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0
        assert_exact(outputs, prompts, reference(path))

        stats = llm.collective_rpc("pipeline_stats")
        assert [s["rank"] for s in stats] == [0, 1] and stats[1]["sampled_sends"] > 0
        with pytest.raises(ValueError, match="worker rank 0: ValueError: no such weights"):
            llm.collective_rpc(refuse, ("no such weights",))
        assert llm.collective_rpc(pid_of) == pids and executor.failure() is None

        llm.engine.core.pause(mode="keep")
        llm.engine.core.resume()
        name = "model.layers.2.self_attn.q_proj.weight"
        changed = [(name, dict(iter_hf_weights(path))[name] * 1.5)]
        assert llm.update_weights(changed) == 1
        outputs = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(8), use_tqdm=False)
        assert_exact(outputs, prompts[:1], HFReference(path, changed), 8)
        llm.sleep(level=2)
        llm.load_weights(path)
        llm.wake_up()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], greedy(),
                               use_tqdm=False)
        assert_exact(outputs, prompts[:2], reference(path))
    assert executor.failure() == "the executor was shut down"
    assert_gone(pids)


def test_smollm2_three_tensor_shards_match_transformers(cluster, smollm2_path, reference):
    """SmolLM2's 9 heads over three ranks, with async scheduling and chunked prefill."""
    prompts = token_ids(smollm2_path)[:3]
    with LLM(smollm2_path, tensor_parallel_size=3, async_scheduling=True,
             max_num_batched_tokens=24, block_size=16, num_kv_blocks=64, **RAY) as llm:
        pids = llm.collective_rpc(pid_of)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8),
                               use_tqdm=False)
    assert_exact(outputs, prompts, reference(smollm2_path), 8)
    assert_gone(pids)


# -- faults ------------------------------------------------------------------------------------
async def stream_until_killed(engine: AsyncLLM, kill, after: int = 5) -> list:
    """Two requests stream; `kill()` runs once the first has `after` tokens. Their finals."""
    killed = []

    async def one(rid: str):
        final = None
        async for out in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, greedy(400), rid):
            final = out
            # At `after` tokens or past them: a lagging stream takes several steps in one output.
            if (rid == "0" and len(out.outputs[0].token_ids) >= after and not out.finished
                    and not killed):
                killed.append(True)
                kill()
        return final

    return await asyncio.wait_for(asyncio.gather(one("0"), one("1")), 60)


def assert_dead(engine: AsyncLLM, finals: list, reason: str) -> None:
    for final in finals:
        assert final.finished and final.outputs[0].finish_reason == "error"
        assert re.search(reason, str(final.outputs[0].stop_reason)), final.outputs[0].stop_reason
    with pytest.raises(EngineDeadError, match=reason):
        asyncio.run(engine.check_health())


def test_a_killed_worker_ends_every_request_with_an_error(cluster, tiny_checkpoints):
    # Two 4-token prompts: a step budget of 256 rather than 2,048 changes no step, and spares
    # the last stage warming its head's GEMM (49,152 rows) up to 2,048 rows at start-up.
    engine = AsyncLLM(tiny_checkpoints["llama"], pipeline_parallel_size=2, async_scheduling=True,
                      block_size=16, num_kv_blocks=64, max_num_batched_tokens=256, **RAY)
    try:
        pids = engine.core.collective_rpc(pid_of)
        node_id = engine.core.executor.nodes[1][1]
        start = time.monotonic()
        finals = asyncio.run(stream_until_killed(engine, lambda: os.kill(pids[1], signal.SIGKILL)))
        assert time.monotonic() - start < 20
        assert_dead(engine, finals, f"worker rank 1 on node .* \\(node id {node_id}\\) died")
    finally:
        engine.shutdown()
    assert_gone(pids)


def test_two_nodes_one_stage_each_then_the_second_node_dies(cluster, tiny_checkpoints,
                                                            reference, monkeypatch):
    """Each stage pinned to a node by a resource only that node has: exact output. Then the
    second node's raylet is killed mid-stream: every request ends with an error naming rank 1
    and that node, the engine reports dead, and nothing hangs."""
    cluster, second = cluster
    head_id = ray.get_runtime_context().get_node_id()
    monkeypatch.setenv(BUNDLES_ENV, json.dumps([{"head": 1}, {"second": 1}]))
    path = tiny_checkpoints["llama"]
    prompts = token_ids(path)[:3]
    engine = AsyncLLM(path, pipeline_parallel_size=2, async_scheduling=True,
                      max_num_batched_tokens=16, block_size=16, num_kv_blocks=64, **RAY)
    try:
        assert [node_id for _, node_id in engine.core.executor.nodes] == [head_id, second.node_id]
        pids = engine.core.collective_rpc(pid_of)

        raylet = psutil.Process(second.all_processes["raylet"][0].process.pid)

        async def body():   # an AsyncLLM keeps to one event loop
            async def one(i: int):
                async for out in engine.generate({"prompt_token_ids": prompts[i]}, greedy(),
                                                 str(i)):
                    final = out
                return final

            assert_exact(await asyncio.gather(*(one(i) for i in range(len(prompts)))),
                         prompts, reference(path))
            return await stream_until_killed(engine, raylet.kill)

        start = time.monotonic()
        finals = asyncio.run(body())
        assert time.monotonic() - start < 30
        assert_dead(engine, finals, f"worker rank 1 on node .* \\(node id {second.node_id}\\)")
    finally:
        engine.shutdown()
        cluster.remove_node(second, allow_graceful=False)
    assert_gone(pids)
