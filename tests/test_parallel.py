"""Worker processes: pipeline and tensor parallelism over gloo, checked token by token against
transformers, and what happens when a worker fails.

Every engine here spawns real worker processes (the `mp` executor), each with one thread. An
autouse fixture checks that no child process outlives a test, passing or failing.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from tests.deferred import defer_and_count, worker_num_deferred
from tests.test_correctness import TEXTS
from treadle import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from treadle.engine.llm_engine import LLMEngine
from treadle.models.loader import load_tokenizer

# A budget of 16 tokens cuts every prompt into several chunks, mixed with running decodes;
# 14 blocks of 16 cannot hold five requests at full length, so some are preempted.
TINY_ARGS = {"max_num_batched_tokens": 16, "block_size": 16, "num_kv_blocks": 14, "max_num_seqs": 5}
MAX_TOKENS = 24
# For the tests that take whole prompts in a step: the few prompts here (99 tokens at most, all
# of TEXTS) fit one step of 256 tokens, as they did the default 2,048. Each rank warms its GEMMs
# up to the budget at start-up, and a last stage's head (the tied embedding's copy, 49,152 rows)
# made most of a two-stage engine's start at 2,048.
STEP_BUDGET = 256


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_worker_left():
    yield
    deadline = time.monotonic() + 10
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children(), f"processes left running: {[p.cmdline() for p in children()]}"


def children() -> list[psutil.Process]:
    """Child processes still running, but multiprocessing's resource tracker, which lives as
    long as this process and exits with it."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if running(p.pid) and "resource_tracker" not in " ".join(p.cmdline()):
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def token_ids(path: str, texts=TEXTS) -> list[list[int]]:
    tok = load_tokenizer(path)
    return [tok.encode(t) for t in texts]


def assert_exact(outputs, prompts, ref, max_tokens: int = MAX_TOKENS) -> None:
    for ids, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == ref.greedy(ids, max_tokens), ids


# -- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    ({"tensor_parallel_size": 2}, "must divide the model's 9 attention heads"),
    ({"pipeline_parallel_size": 31}, "exceeds the model's 30 layers"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, "world size 2 needs 'mp'"),
    ({"distributed_executor_backend": "threads"}, "must be one of mp, ray, uni"),
    ({"max_worker_restarts": 1}, "max_worker_restarts replaces worker processes: it needs "
                                 "distributed_executor_backend 'mp', got 'uni'"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram"}},
     "speculative decoding with pipeline_parallel_size > 1"),
    ({"pipeline_parallel_size": 2, "master_port": 70000}, "master_port must be in 1..65535"),
])
def test_a_split_the_model_cannot_take_is_refused_before_any_process(args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args).create_config()


# -- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, pp, tp, async_scheduling", [
    ("llama", 2, 1, False),    # tied head: the last stage holds its own copy of the embedding
    ("qwen2", 1, 2, False),    # q/k/v biases, one KV head per rank
    ("qwen3", 2, 1, True),     # q/k norms; the token ledger across three steps in flight
    ("llama", 1, 1, True),     # the mp executor with one worker
    ("llama", 3, 1, False),    # a middle stage: neither the embedding nor the head
])
def test_tiny_models_match_transformers(tiny_checkpoints, reference, arch, pp, tp, async_scheduling):
    path = tiny_checkpoints[arch]
    prompts = token_ids(path) + [token_ids(path, [TEXTS[3] * 3])[0][:120]]   # 8 chunks
    with LLM(path, pipeline_parallel_size=pp, tensor_parallel_size=tp,
             distributed_executor_backend="mp", async_scheduling=async_scheduling,
             **TINY_ARGS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0   # the budget forced some
    assert_exact(outputs, prompts, reference(path))


def test_a_lone_worker_process_defers_its_steps_and_stays_exact(tiny_checkpoints, reference):
    """executor/mp.py: a lone worker holds a deferred step's reply until the next step is queued
    behind it, or until the engine, waiting with no later step sent, says FINISH_STEP (one
    request alone: every step). On a GPU it defers by itself; here it is told to. Chunks,
    preemptions and a slot's new tenants come between deferred steps."""
    path = tiny_checkpoints["llama"]
    prompts = token_ids(path) + [token_ids(path, [TEXTS[3] * 3])[0][:120]]
    # A step whose reply never comes would hang the engine: end the run with every thread's
    # stack instead of waiting for CI's limit.
    faulthandler.dump_traceback_later(300, exit=True)
    try:
        with LLM(path, distributed_executor_backend="mp", async_scheduling=True, **TINY_ARGS) as llm:
            executor = llm.engine.core.executor
            assert not executor.defers_steps   # on a CPU, not unless told
            assert llm.collective_rpc(defer_and_count) == [True]
            executor.defers_steps = True
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                                   use_tqdm=False)
            assert llm.get_stats().num_preemptions > 0
            alone = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(), use_tqdm=False)
            assert llm.collective_rpc(worker_num_deferred)[0] > 2 * MAX_TOKENS
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert_exact(outputs + alone, prompts + prompts[:1], reference(path))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_smollm2_two_stages_match_transformers(smollm2_path, reference, async_scheduling):
    prompts = token_ids(smollm2_path)
    with LLM(smollm2_path, pipeline_parallel_size=2, async_scheduling=async_scheduling,
             max_num_batched_tokens=24, block_size=16, num_kv_blocks=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16),
                               use_tqdm=False)
    assert_exact(outputs, prompts, reference(smollm2_path), 16)


@pytest.mark.slow
def test_smollm2_three_tensor_shards_match_transformers(smollm2_path, reference):
    """SmolLM2's 9 heads and 3 KV heads split three ways (two ways is refused above)."""
    prompts = token_ids(smollm2_path)[:3]
    with LLM(smollm2_path, tensor_parallel_size=3, max_num_batched_tokens=24,
             block_size=16, num_kv_blocks=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12),
                               use_tqdm=False)
    assert_exact(outputs, prompts, reference(smollm2_path), 12)


# -- invariant 4: no stage waits for tokens that are not coming ----------------------------------
def test_all_chunk_steps_send_no_sampled_tokens(tiny_checkpoints, reference):
    """The seed scenario: two stages, async scheduling, only long prompts, each cut into many
    chunks. Steps in which every request is a non-final chunk sample nothing, and the stages
    send no sampled-token message for them: the count equals the steps that sampled."""
    path = tiny_checkpoints["llama"]
    tok = load_tokenizer(path)
    prompts = [tok.encode((TEXTS[3] + " ") * 8)[:300 + 7 * i] for i in range(4)]
    engine = LLMEngine.from_engine_args(EngineArgs(
        path, pipeline_parallel_size=2, async_scheduling=True, max_num_batched_tokens=32,
        block_size=16, num_kv_blocks=128, enable_prefix_caching=False))   # no hits: every token is computed
    sampling_steps = all_steps = 0
    schedule = engine.core.scheduler.schedule

    def counting_schedule():
        nonlocal sampling_steps, all_steps
        out = schedule()
        all_steps += out.total_num_scheduled_tokens > 0
        sampling_steps += bool(out.num_in_flight_tokens)
        return out

    engine.core.scheduler.schedule = counting_schedule
    finals = {}
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, greedy(2))
        done = threading.Event()

        def run():
            while engine.has_unfinished_requests():
                finals.update((o.request_id, o) for o in engine.step() if o.finished)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        assert done.wait(60), "the pipeline hung"
        stats = engine.core.collective_rpc("pipeline_stats")
    finally:
        engine.core.shutdown()
    # 1,124 prompt tokens in chunks of 32: about 35 steps, of which only those holding a final
    # chunk or a decode sample.
    assert all_steps - sampling_steps >= 25
    first, last = stats
    assert last["sampled_sends"] == sampling_steps
    assert first["sampled_recvs"] <= sampling_steps and first["sampled_sends"] == 0
    assert_exact([finals[str(i)] for i in range(4)], prompts, reference(path), 2)


# -- RL controls reach every worker -----------------------------------------------------------
@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2)])
def test_pause_keep_with_cache_clear_and_reset_stay_exact(tiny_checkpoints, reference, pp, tp):
    path = tiny_checkpoints["qwen2"]
    prompts = token_ids(path)
    engine = LLMEngine.from_engine_args(EngineArgs(
        path, pipeline_parallel_size=pp, tensor_parallel_size=tp, async_scheduling=True,
        max_num_batched_tokens=32, block_size=16, num_kv_blocks=64))
    finals = {}

    def steps(n: int | None = None) -> None:
        while engine.has_unfinished_requests() and (n is None or n > 0):
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
            n = None if n is None else n - 1

    try:
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, greedy())
        steps(6)
        engine.core.pause(mode="keep", clear_cache=True)
        assert engine.core.scheduler.num_in_flight_tokens() == 0
        engine.core.resume()
        steps(8)
        assert engine.core.reset_prefix_cache(reset_running_requests=True)
        steps()
    finally:
        engine.core.shutdown()
    assert_exact([finals[str(i)] for i in range(len(prompts))], prompts, reference(path))


@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2)])
def test_weight_updates_reach_every_shard_or_none(tiny_checkpoints, reference, pp, tp):
    """A tied embedding (the first stage's input, the last stage's head), a sharded q_proj on
    the last stage: transformers with the same overrides is the reference. An update one rank
    refuses changes nothing on any rank. Then sleep(level=2) drops every shard's weights and
    the KV cache, and load_weights + wake_up bring back the original model."""
    from tests.reference import HFReference
    from treadle.models.loader import iter_hf_weights

    path = tiny_checkpoints["llama"]
    weights = dict(iter_hf_weights(path))
    gen = torch.Generator().manual_seed(1)
    overrides = [(name, weights[name] + 0.05 * torch.randn(weights[name].shape, generator=gen))
                 for name in ("model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight")]
    prompts = token_ids(path)[:3]
    with LLM(path, pipeline_parallel_size=pp, tensor_parallel_size=tp, block_size=16, num_kv_blocks=64,
             max_num_batched_tokens=STEP_BUDGET) as llm:
        assert llm.update_weights(overrides) == 2
        bad = [("model.layers.1.mlp.up_proj.weight", weights["model.layers.0.mlp.up_proj.weight"]),
               ("model.layers.2.mlp.down_proj.weight", torch.zeros(64, 130))]
        with pytest.raises(ValueError, match="down_proj"):
            llm.update_weights(bad)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert_exact(outputs, prompts, HFReference(path, overrides))
        llm.sleep(level=2)
        llm.load_weights(path)
        llm.wake_up()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert_exact(outputs, prompts, reference(path))


# -- faults ----------------------------------------------------------------------------------------
def test_a_killed_worker_ends_every_request_with_an_error(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    engine = AsyncLLM(path, pipeline_parallel_size=2, block_size=16, num_kv_blocks=64,
                      max_num_batched_tokens=STEP_BUDGET)
    pids = [p.pid for p in engine.core.executor.procs]

    async def body():
        killed = []

        async def one(rid: str):
            final = None
            async for out in engine.generate({"prompt_token_ids": [1, 2, 3, 4]},
                                             greedy(200), rid):
                final = out
                # At 5 tokens or past them: a lagging stream takes several steps in one output.
                if (rid == "0" and len(out.outputs[0].token_ids) >= 5 and not out.finished
                        and not killed):
                    killed.append(pids[1])
                    os.kill(pids[1], signal.SIGKILL)
            return final

        start = time.monotonic()
        finals = await asyncio.wait_for(asyncio.gather(one("0"), one("1")), 30)
        elapsed = time.monotonic() - start
        for final in finals:
            assert final.finished and final.outputs[0].finish_reason == "error"
            assert "worker rank 1 died" in str(final.outputs[0].stop_reason)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("more", greedy(), "2"):
                pass
        return elapsed

    try:
        assert asyncio.run(body()) < 20
    finally:
        engine.shutdown()
    assert not any(running(pid) for pid in pids)


def test_serve_with_two_stages_and_a_worker_killed(tiny_checkpoints, reference, tmp_path):
    """`treadle serve --pipeline-parallel-size 2`: exact completions through the openai SDK;
    then a worker is killed mid-stream: the stream ends with finish_reason "error", /health
    says 503, and the server still shuts down cleanly, leaving no worker behind."""
    from tests.test_server import MODEL, Server, StreamReader, spawned_by

    path = tiny_checkpoints["llama"]
    ids = token_ids(path)[0]
    srv = Server(path, tmp_path, "--pipeline-parallel-size", "2", "--async-scheduling",
                 "--max-num-batched-tokens", str(STEP_BUDGET))
    try:
        client = srv.client()
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == load_tokenizer(path).decode(reference(path).greedy(ids, 16))
        [core] = spawned_by(srv.proc.pid)   # the engine core's process, which spawned the workers
        workers = spawned_by(core.pid)
        assert len(workers) == 2
        reader = StreamReader(client, prompt=ids, max_tokens=200, temperature=0,
                              extra_body={"ignore_eos": True})
        reader.wait_for_chunks(3)
        workers[1].kill()
        _, finish_reason = reader.result(timeout=20)
        assert finish_reason == "error"
        status, body = srv.request("GET", "/health")
        assert status == 503 and "worker rank" in body["error"]["message"], body
    finally:
        assert srv.stop() == 0, srv.log()
    assert not any(running(p.pid) for p in [core, *workers])


def test_a_restarted_worker_group_loses_no_request(tiny_checkpoints, reference):
    """With max_worker_restarts=1, a worker killed mid-run is replaced (on the same master
    port, and with the KV cache sized by memory again): every request resumes by recompute and
    ends exactly as transformers says. A second death ends the engine."""
    path = tiny_checkpoints["qwen3"]
    prompts = token_ids(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = LLMEngine.from_engine_args(EngineArgs(
        path, pipeline_parallel_size=2, async_scheduling=True, max_worker_restarts=1,
        max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20, master_port=port))
    finals = {}

    def step() -> None:
        finals.update((o.request_id, o) for o in engine.step() if o.finished)

    try:
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, greedy())
        for _ in range(8):
            step()
        first = [p.pid for p in engine.core.executor.procs]
        os.kill(first[1], signal.SIGKILL)
        while engine.has_unfinished_requests():
            step()
        assert engine.core.num_worker_restarts == 1
        assert not {p.pid for p in engine.core.executor.procs} & set(first)
        engine.core.scheduler.kv_cache.assert_no_leaks()
        assert_exact([finals[str(i)] for i in range(len(prompts))], prompts, reference(path))

        engine.add_request("again", {"prompt_token_ids": prompts[0]}, greedy())
        step()
        os.kill(engine.core.executor.procs[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="worker rank 0 died"):
            while engine.has_unfinished_requests():
                step()
    finally:
        engine.core.shutdown()


def kill_this_worker(worker) -> None:
    """Given to collective_rpc: the worker dies in the call."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_lone_worker_that_dies_in_a_control_call_is_replaced_with_a_step_in_flight(
        tiny_checkpoints, reference):
    """A deferring lone worker killed by a control call while the batch queue still holds a
    step: the call fails, not applied, and the worker is replaced at once, as when a step
    finds it dead (the call used to raise the death itself, which AsyncLLM took for the
    engine's: a helper's find); the step in flight is lost with the group, never sent
    FINISH_STEP on a closed socket, and the request ends as transformers says."""
    path = tiny_checkpoints["llama"]
    prompt = token_ids(path)[0]
    engine = LLMEngine.from_engine_args(EngineArgs(
        path, distributed_executor_backend="mp", async_scheduling=True, max_worker_restarts=1,
        max_num_batched_tokens=16, block_size=16, num_kv_blocks=64))
    try:
        assert engine.core.collective_rpc(defer_and_count) == [True]
        engine.core.executor.defers_steps = True
        engine.add_request("a", {"prompt_token_ids": prompt}, greedy())
        for _ in range(8):
            engine.step()
        assert len(engine.core.batch_queue) == 1
        with pytest.raises(RuntimeError, match="worker rank 0 died.*the call was not applied"):
            engine.core.collective_rpc(kill_this_worker)
        assert engine.core.num_worker_restarts == 1 and not engine.core.batch_queue
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
        assert_exact(finals, [prompt], reference(path))
    finally:
        engine.core.shutdown()


def fail_loads_on_rank_1(worker) -> None:
    """Given to collective_rpc: rank 1's next load_weights fails, after every rank checked it."""
    if worker.ctx.rank == 1:
        def broken(path: str) -> int:
            raise OSError("injected: a read error")
        worker.runner.load_weights = broken


def die_in_loads_on_rank_1(worker) -> None:
    """Given to collective_rpc: rank 1's process exits in its next load_weights."""
    if worker.ctx.rank == 1:
        worker.runner.load_weights = lambda path: os._exit(3)


@pytest.mark.parametrize("breaks, restarts, message", [
    # The death was once handled as a control call's, and then again as a change that failed
    # part way, which gave up the new group too (with one restart allowed, ending the engine).
    (die_in_loads_on_rank_1, 2, "worker rank 1 died.*not applied.*restarted"),
    # Every rank checked the change, then one failed it and the others applied it: the model
    # was neither weights, served on as the old ones, with the error the caller's (a 400; a
    # helper's find).
    (fail_loads_on_rank_1, 1, "changed in part.*injected.*workers were restarted"),
], ids=["a_rank_dies", "a_rank_fails"])
def test_a_weight_change_broken_on_one_rank_replaces_the_group_once(tiny_checkpoints, reference,
                                                                     breaks, restarts, message):
    """The group is replaced once, reloading the weights it served before."""
    path = tiny_checkpoints["llama"]
    prompts = token_ids(path)[:2]
    with LLM(path, tensor_parallel_size=2, max_worker_restarts=restarts, block_size=16,
             num_kv_blocks=64, max_num_batched_tokens=64) as llm:
        llm.collective_rpc(breaks)
        with pytest.raises(RuntimeError, match=message):
            llm.load_weights(path, weight_version="new")
        assert llm.engine.core.num_worker_restarts == 1 and llm.get_weight_version() == 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert_exact(outs, prompts, reference(path))


def test_no_restart_once_the_checkpoint_changed_on_disk(tiny_checkpoints, tmp_path):
    """A restart reloads the checkpoint's files: changed since start-up (a trainer saving into
    the folder served), they would be other weights under the same identity and label."""
    path = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoints["llama"], path)
    engine = LLMEngine.from_engine_args(EngineArgs(
        path, distributed_executor_backend="mp", max_worker_restarts=1, block_size=16,
        num_kv_blocks=64))
    try:
        weights = os.path.join(path, "model.safetensors")
        os.utime(weights, ns=(0, os.stat(weights).st_mtime_ns + 10**9))   # rewritten, say
        engine.add_request("a", {"prompt_token_ids": token_ids(path)[0]}, greedy())
        engine.step()
        os.kill(engine.core.executor.procs[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="checkpoint files .* changed since"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.core.shutdown()


def fail_the_forward_on_rank_1(worker) -> None:
    """Given to collective_rpc: rank 1's next forward pass raises."""
    if worker.ctx.rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("injected forward failure")
        worker.runner.model.forward = broken


def test_an_exception_in_a_forward_is_an_engine_error_naming_the_rank(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with LLM(path, tensor_parallel_size=2, block_size=16, num_kv_blocks=64) as llm:
        llm.collective_rpc(fail_the_forward_on_rank_1)
        with pytest.raises(EngineDeadError, match="worker rank 1 failed a step: "
                                                  "RuntimeError: injected forward failure"):
            llm.generate("hello", greedy(4), use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.collective_rpc("pipeline_stats")


def test_a_port_in_use_is_a_clear_start_up_error(tiny_checkpoints):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}.*port in use"):
            LLM(tiny_checkpoints["llama"], pipeline_parallel_size=2, master_port=port)


def test_a_worker_that_cannot_load_the_model_names_its_rank(tiny_checkpoints, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["llama"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank [01] failed to start"):
        LLM(str(broken), pipeline_parallel_size=2)
    assert time.monotonic() - start < 60


def test_workers_exit_when_their_parent_is_killed(tiny_checkpoints, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from treadle import LLM
        if __name__ == "__main__":
            llm = LLM({tiny_checkpoints["llama"]!r}, pipeline_parallel_size=2, block_size=16, num_kv_blocks=32,
                      max_num_batched_tokens={STEP_BUDGET})
            executor = llm.engine.core.executor
            print(executor._ipc_dir, *(p.pid for p in executor.procs), flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ipc_dir, *pids = parent.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and os.path.isdir(ipc_dir)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in pids), "workers outlived their parent"
    assert not os.path.exists(ipc_dir), "the socket's folder outlived the workers"


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def num_blocks_of(worker) -> int:
    return worker.runner.num_blocks


def test_a_callers_mistake_in_collective_rpc_is_the_callers_error(tiny_checkpoints, reference,
                                                                  tmp_path):
    """executor/base.py's contract, kept by the mp executor too: a misspelt method, or a
    callable a worker process cannot unpickle (from a module only the caller imports: a
    notebook cell), is the caller's error, and the workers serve on. Both killed every worker
    process, and the engine was dead."""
    path = tiny_checkpoints["llama"]
    prompts = token_ids(path)[:2]
    with LLM(path, tensor_parallel_size=2, block_size=16, num_kv_blocks=64,
             max_num_batched_tokens=64) as llm:
        with pytest.raises(AttributeError, match="no_such_method"):
            llm.collective_rpc("no_such_method")
        (tmp_path / "caller_only.py").write_text("def probe(worker):\n    return 1\n")
        sys.path.insert(0, str(tmp_path))   # after the workers started: they cannot import it
        try:
            import caller_only
            with pytest.raises(Exception, match="caller_only"):
                llm.collective_rpc(caller_only.probe)
        finally:
            sys.path.remove(str(tmp_path))
            sys.modules.pop("caller_only", None)
        assert llm.collective_rpc(num_blocks_of) == [64, 64]
        assert llm.engine.core.num_worker_restarts == 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert_exact(outs, prompts, reference(path))
