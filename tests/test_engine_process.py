"""The engine core in a process of its own (`AsyncLLM(engine_process=True)`, `treadle serve
--engine-process`): the same tokens as transformers, the RL controls and their errors across
the process boundary, and a core process that dies ending every request with an error."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future
import urllib.request

import openai
import psutil
import pytest
import torch

from tests.reference import HFReference
from tests.test_server import MODEL, PROMPTS, Server, StreamReader, assert_error, spawned_by
from treadle import AsyncLLM, EngineArgs, SamplingParams
from treadle.engine.core import EngineCore
from treadle.engine.core_client import EngineCoreProcess
from treadle.engine.errors import EngineBusyError
from treadle.models.loader import load_tokenizer


def _refuse() -> None:
    raise RuntimeError("not built here")


class Unreadable:
    """Pickles in this process, and will not unpickle in any other."""

    def __reduce__(self):
        return _refuse, ()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def run(engine: AsyncLLM, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, greedy(max_tokens), request_id):
        final = out
    return final.outputs[0].token_ids


def test_async_llm_in_a_process_matches_transformers_through_pause_keep_and_weight_updates(
        llama, reference, original_weights):
    """Under async scheduling: concurrent requests, a pause(keep) that drops the cache and the
    running requests' KV, and a weight update with tensors that cross the process."""
    ref = reference(llama)
    prompts = [[5 + i, 17, 3 * i + 2, 40, 9] for i in range(4)]
    changed = {name: t * 1.01 if name.endswith("mlp.down_proj.weight") else t
               for name, t in original_weights.items()}

    async def body(engine: AsyncLLM) -> None:
        first = asyncio.gather(*(run(engine, p, 24, f"a{i}") for i, p in enumerate(prompts)))
        await asyncio.sleep(0.3)
        await engine.pause_generation(mode="keep", clear_cache=True)
        assert await engine.is_paused()
        await engine.resume_generation()
        for p, tokens in zip(prompts, await first):
            assert tokens == ref.greedy(p, 24)

        # Refused while a request runs unpaused: the core's RuntimeError, as on the thread.
        task = asyncio.create_task(run(engine, prompts[0], 200, "long"))
        await asyncio.sleep(0.2)
        with pytest.raises(RuntimeError, match="paused or idle"):
            await engine.update_weights(list(changed.items()))
        await task
        with pytest.raises(ValueError, match="no_such"):
            await engine.update_weights([("no_such.weight", torch.zeros(2))])
        assert await engine.update_weights(list(changed.items()), weight_version="v2") > 0
        assert await engine.get_weight_version() == "v2"
        got = await run(engine, prompts[1], 16, "after")
        assert got == HFReference(llama, list(changed.items())).greedy(prompts[1], 16)

        # What cannot cross the process says so; what can comes back.
        with pytest.raises(TypeError, match="cannot be sent to the engine core process"):
            await engine.collective_rpc(lambda worker: 1)
        with pytest.raises(TypeError, match="cannot read this call: not built here"):
            await engine.collective_rpc("load_model", (Unreadable(),))
        stats = await engine.get_stats()
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        assert (await engine.get_engine_status())["running"] == []
        await engine.pause_generation(mode="abort")
        with pytest.raises(EngineBusyError):
            await run(engine, prompts[0], 4, "refused")
        await engine.resume_generation()

    engine = AsyncLLM(llama, engine_process=True, async_scheduling=True, max_num_seqs=3,
                      max_num_batched_tokens=16)
    assert engine.core is None
    try:
        asyncio.run(body(engine))
    finally:
        engine.shutdown()


def test_a_core_that_cannot_start_raises_its_own_error(llama, tmp_path):
    """A checkpoint whose weights are cut short passes the frontend's checks (config.json) and
    fails in the core process, as it loads them: the error comes back, and nothing stays."""
    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file"):
        AsyncLLM(str(broken), engine_process=True)
    assert spawned_by(os.getpid()) == []


def test_calls_sent_as_the_core_process_dies_fail_and_never_block(llama):
    """Calls keep coming (requests, aborts, /metrics) as the process is killed: a call sent
    before the death is seen once went into a ZeroMQ PUSH with no peer left, which waits for
    good, holding the lock the receiving thread needed to fail it: the server hung."""
    config = EngineArgs(model=llama, max_model_len=256, num_kv_blocks=24).create_config()
    core = EngineCoreProcess(config, lambda outputs, weights: None, lambda exc: None)
    try:
        core.call(EngineCore.get_stats).result(30)
        calls: list[Future] = []

        def caller() -> None:
            while core.failure() is None:
                calls.append(core.call(EngineCore.get_stats))

        thread = threading.Thread(target=caller, daemon=True)
        thread.start()
        time.sleep(0.2)
        os.kill(core._proc.pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive(), "a call blocked on the dead process"
        assert "exited with code -9" in str(core.failure())
        for call in calls:   # each answered before the death, or failed with it
            assert call.done() or call.exception(10) is not None
    finally:
        if not core._send_lock.locked():   # else stop() would block on it too
            core.stop()


# -- `treadle serve --engine-process`, its core with a worker process of its own ----------------
@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    srv = Server(llama, tmp_path_factory.mktemp("server"), "--engine-process",
                 "--distributed-executor-backend", "mp")
    yield srv
    assert srv.stop() == 0, srv.log()   # with its core process killed by the last test, too


def test_served_from_a_core_process_the_tokens_are_transformers(server, llama, reference):
    tokenizer = load_tokenizer(llama)
    client = server.client()
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == reference(llama).greedy(ids, 16)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text


def test_served_controls_cross_the_process(server, llama):
    client = server.client()
    reader = StreamReader(client, prompt=PROMPTS[0], max_tokens=200, temperature=0,
                          extra_body={"ignore_eos": True})
    reader.wait_for_chunks(2)
    assert_error(*server.request("POST", "/update_weights_from_disk", {"path": llama}), 409)
    assert server.request("POST", "/pause?mode=keep")[0] == 200
    assert server.request("POST", "/resume")[0] == 200
    assert reader.result()[1] == "length"
    status, body = server.request("POST", "/update_weights_from_disk",
                                  {"path": llama, "weight_version": "v2"})
    assert status == 200 and body["num_tensors"] > 0, body
    assert server.request("GET", "/weight_version") == (200, {"weight_version": "v2"})
    assert server.request("POST", "/sleep?level=1")[0] == 200
    assert server.request("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert server.request("POST", "/wake_up")[0] == 200
    assert server.request("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert server.request("POST", "/reset_prefix_cache")[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        assert b"treadle:" in r.read()
    assert_error(*server.request("POST", "/v1/completions",
                                 {"model": MODEL, "prompt": "x", "top_k": -7}), 400)


def test_a_killed_core_process_ends_streams_and_health_with_an_error(server):
    client = server.client()
    reader = StreamReader(client, prompt=PROMPTS[1], max_tokens=200, temperature=0,
                          extra_body={"ignore_eos": True})
    reader.wait_for_chunks(2)
    core = spawned_by(server.proc.pid)
    assert len(core) == 1, core
    workers = core[0].children()
    assert workers, "the mp executor's worker runs under the core process"
    os.kill(core[0].pid, signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the open stream hung on a dead engine"
    assert reader.error is not None or reader.finish_reason not in ("length", None)
    deadline = time.monotonic() + 10
    while server.request("GET", "/health")[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code >= 500
    psutil.wait_procs(workers, timeout=10)   # the worker follows its parent out
    assert not any(w.is_running() for w in workers)


def test_a_killed_server_takes_its_core_process_with_it(llama, tmp_path):
    """SIGKILL runs no clean-up in the server: its core process sees itself orphaned and exits."""
    srv = Server(llama, tmp_path)
    core = spawned_by(srv.proc.pid)
    assert len(core) == 1, core
    srv.proc.kill()
    srv.proc.wait(30)
    gone, alive = psutil.wait_procs(core, timeout=15)
    assert not alive, "the engine core process outlived its server"


def test_sigterm_to_the_server_and_its_core_at_once_still_lets_streams_finish(llama, tmp_path):
    """As `timeout` or systemd signal a whole process group: the core process leaves its end to
    the server, which lets the open stream finish within --shutdown-timeout and exits 0."""
    srv = Server(llama, tmp_path, "--shutdown-timeout", "30")
    try:
        [core] = spawned_by(srv.proc.pid)
        reader = StreamReader(srv.client(), prompt=PROMPTS[1], max_tokens=200, temperature=0,
                              extra_body={"ignore_eos": True})
        reader.wait_for_chunks(3)
        os.kill(core.pid, signal.SIGTERM)
        srv.proc.send_signal(signal.SIGTERM)
        _, finish = reader.result()
        assert finish == "length"
    finally:
        assert srv.stop(60) == 0, srv.log()
    psutil.wait_procs([core], timeout=15)
    assert not core.is_running()


def test_a_long_tmpdir_moves_the_sockets_to_tmp(llama, tmp_path, reference):
    """An AF_UNIX path holds 107 bytes: under a TMPDIR of 100 characters the core process's
    sockets, and its mp worker's, once failed to bind and the server never started."""
    long_tmp = tmp_path / ("t" * max(1, 100 - len(str(tmp_path)) - 1))
    long_tmp.mkdir()
    assert len(str(long_tmp)) >= 100
    srv = Server(llama, tmp_path, "--distributed-executor-backend", "mp",
                 env={"TMPDIR": str(long_tmp)})
    try:
        prompt = [5, 17, 2, 40, 9]
        out = srv.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == reference(llama).greedy(prompt, 8)
    finally:
        assert srv.stop() == 0, srv.log()
    assert srv.log_path.read_text().count("too long for ipc socket paths") == 2, srv.log()   # core, worker


def test_a_temporary_folder_too_long_everywhere_is_a_clear_error(monkeypatch, tmp_path):
    from treadle.executor import ipc

    monkeypatch.setattr(ipc.tempfile, "tempdir", str(tmp_path / ("x" * 120)))
    monkeypatch.setattr(ipc, "FALLBACK_DIR", str(tmp_path / ("y" * 120)))
    with pytest.raises(OSError, match="too long for a socket path .* set TMPDIR"):
        ipc.socket_folder("treadle-core-")
