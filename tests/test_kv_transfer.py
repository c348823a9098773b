"""KV connectors: configuration, the shared-storage connector between engines, and exact
recovery from failed loads, checked against transformers."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import pytest

from tests.kv_fixtures import (BLOCK, MAX_TOKENS, connector_of, copy_store, greedy, kv_config,
                               prompts, store)  # noqa: F401 (fixtures)
from treadle import LLM, AsyncLLM
from treadle.config import EngineArgs


def run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return outs


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ({"kv_connector": "NoSuchConnector"}, "kv_connector must be one of MultiConnector, "
                                          "OffloadingConnector, RedisConnector, "
                                          "SharedStorageConnector"),
    ({"kv_role": "kv_sender"}, "kv_role must be one of kv_producer, kv_consumer, kv_both"),
    ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be one of recompute, fail"),
    ({"kv_connector_extra_config": {}}, "needs shared_storage_path"),
    ({"kv_buffer_size": 1}, "unknown keys"),
])
def test_bad_kv_transfer_config_names_the_field_before_any_model_loads(tmp_path, bad, field):
    config = {**kv_config(tmp_path, "kv_both"), **bad}
    # The model does not exist: the config must be refused before anything looks for it.
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=str(tmp_path / "no-model"), kv_transfer_config=config).create_config()


def test_kv_transfer_config_as_json_and_without_a_connector(tmp_path):
    with pytest.raises(ValueError, match="kv_transfer_config is not valid JSON"):
        EngineArgs(model="x", kv_transfer_config="{nope").create_config()
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector is required"):
        EngineArgs(model="x", kv_transfer_config={"kv_role": "kv_both"}).create_config()


# -- a producer and a consumer ----------------------------------------------------------------
@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_consumer_loads_the_producers_kv_and_matches_transformers(llama, reference, prompts,
                                                                   store, async_scheduling,
                                                                   load_async):
    consumer = LLM(llama, block_size=BLOCK, async_scheduling=async_scheduling, kv_transfer_config=kv_config(
        store, "kv_consumer", load_async=load_async, inject_load_delay_s=0.02 * load_async))
    outs = run(consumer, prompts)
    ref = reference(llama)
    assert [o.outputs[0].token_ids for o in outs] == [ref.greedy(p, MAX_TOKENS) for p in prompts]
    # Every whole block before the last prompt token came from the store (the 9-token prompt
    # has none), and nothing failed.
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert connector_of(consumer).num_loaded_blocks > 0
    assert connector_of(consumer).num_failed_loads == 0
    assert not list(store.glob(".tmp-*"))


@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_thirty_percent_of_loads_failing_under_recompute_is_exact(llama, reference, prompts,
                                                                  store, async_scheduling,
                                                                  load_async):
    consumer = LLM(llama, block_size=BLOCK, async_scheduling=async_scheduling, kv_transfer_config=kv_config(
        store, "kv_consumer", inject_load_failure_rate=0.3, inject_seed=3, load_async=load_async))
    outs = run(consumer, prompts * 2)
    ref = reference(llama)
    assert [o.outputs[0].token_ids for o in outs] == [ref.greedy(p, MAX_TOKENS) for p in prompts * 2]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert connector_of(consumer).num_failed_loads > 0
    assert connector_of(consumer).num_loaded_blocks > 0


@pytest.mark.parametrize("load_async", [False, True])
def test_fail_policy_ends_the_failed_requests_with_an_error(llama, reference, prompts, store,
                                                            load_async):
    # The second block of every load fails: prompts with two or more stored blocks end.
    consumer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(
        store, "kv_consumer", policy="fail", inject_failed_block_indices=[1],
        load_async=load_async))
    outs = run(consumer, prompts)
    ref = reference(llama)
    for p, out in zip(prompts, outs):
        completion = out.outputs[0]
        if (len(p) - 1) // 16 >= 2:
            assert completion.finish_reason == "error" and completion.token_ids == []
            # Named by the client's id, not the engine's (`<id>-<n>`: engine/input_processor.py).
            assert completion.stop_reason.startswith(f"request {out.request_id}: KV block 1 ")
            assert "failed to load" in completion.stop_reason
        else:
            assert completion.token_ids == ref.greedy(p, MAX_TOKENS)
    assert sum(o.outputs[0].finish_reason == "error" for o in outs) == 2


def test_a_corrupted_block_is_a_load_error_and_is_recomputed(llama, reference, prompts, store,
                                                             tmp_path):
    damaged = copy_store(store, tmp_path)
    for f in damaged.glob("*.kv"):
        data = bytearray(f.read_bytes())
        data[-7] ^= 0xFF            # inside the tensor data: the checksum must catch it
        f.write_bytes(bytes(data))
    consumer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(damaged, "kv_consumer"))
    outs = run(consumer, prompts)
    ref = reference(llama)
    assert [o.outputs[0].token_ids for o in outs] == [ref.greedy(p, MAX_TOKENS) for p in prompts]
    assert connector_of(consumer).num_loaded_blocks == 0
    failed = connector_of(consumer).num_failed_loads
    assert failed > 0
    # Each damaged file went as its load failed, as RedisConnector drops a damaged value: it
    # was loaded again by every later request with the prefix, which under policy "fail"
    # ended them all (a helper's find).
    consumer.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in run(consumer, prompts)] == \
        [ref.greedy(p, MAX_TOKENS) for p in prompts]
    assert connector_of(consumer).num_failed_loads == failed


def test_other_weights_at_the_same_path_never_load_its_kv(tmp_path):
    """Blocks named the model by its path: an engine on other weights in the same folder (a
    "latest" folder a trainer rewrites, a model redeployed) loaded KV the old ones computed."""
    from tests.reference import HFReference
    from tests.tiny_models import make_tiny_checkpoint

    path, store = tmp_path / "model", tmp_path / "kv"
    prompt = list(range(1000, 1000 + 4 * BLOCK + 3))
    for seed in (0, 1):
        shutil.rmtree(path, ignore_errors=True)
        make_tiny_checkpoint("llama", tmp_path / f"seed{seed}", seed=seed)
        shutil.copytree(tmp_path / f"seed{seed}", path)
        llm = LLM(str(path), block_size=BLOCK, kv_transfer_config=kv_config(store, "kv_both"))
        out = run(llm, [prompt])[0]
        assert connector_of(llm).num_loaded_blocks == 0, "KV of other weights was loaded"
        assert out.outputs[0].token_ids == HFReference(str(path)).greedy(prompt, MAX_TOKENS)
        del llm
    assert len(list(store.glob("*.kv"))) == 2 * 4   # each model's blocks, under its own names


def test_kv_of_other_weights_is_never_loaded(llama, reference, prompts, store, tmp_path):
    """After a weight update the stored blocks (of the old weights) no longer match."""
    consumer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(copy_store(store, tmp_path), "kv_both"))
    weights = consumer.collective_rpc(lambda worker: [
        (n, p.detach().clone()) for n, p in worker.runner.model.named_parameters()
        if n == "model.norm.weight"])[0]
    consumer.update_weights([(weights[0][0], weights[0][1] * 1.0)], weight_version="same-values")
    outs = run(consumer, prompts[:1])
    assert outs[0].num_cached_tokens == 0
    assert outs[0].outputs[0].token_ids == reference(llama).greedy(prompts[0], MAX_TOKENS)


def test_a_load_counts_its_bytes_once_it_is_done(llama, prompts, store):
    """bytes_loaded, a Prometheus counter, counts what the workers loaded: nothing while an
    asynchronous load is in flight (it counted every hit at admission), each hit once done."""
    consumer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(
        store, "kv_consumer", load_async=True, inject_load_delay_s=0.5))
    engine = consumer.engine
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy())
    engine.step()   # admitted: its load starts
    tier = consumer.get_stats().kv_tiers[0]
    assert tier.hits > 0 and tier.bytes_loaded == 0
    while engine.has_unfinished_requests():
        engine.step()
    tier = consumer.get_stats().kv_tiers[0]
    assert tier.bytes_loaded == tier.hits * engine.core.scheduler.connector.block_bytes > 0


def test_aborting_during_an_async_load_frees_everything(llama, reference, prompts, store):
    """A stream closed while its KV loads: the blocks stay held until the load is done, then
    everything is free, and the engine serves the next request exactly."""
    engine = AsyncLLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(
        store, "kv_consumer", load_async=True, inject_load_delay_s=0.5))

    async def body() -> list[int]:
        stream = engine.generate({"prompt_token_ids": prompts[0]}, greedy(), request_id="gone")
        task = asyncio.create_task(anext(stream))
        for _ in range(100):                 # until the request waits for its load (0.5 s)
            if engine.core.scheduler.loading:
                break
            await asyncio.sleep(0.01)
        assert engine.core.scheduler.loading, "the load should still be going"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        out = None
        async for out in engine.generate({"prompt_token_ids": prompts[1]}, greedy(),
                                         request_id="next"):
            pass
        await asyncio.wrap_future(engine._core.when_idle())
        return out.outputs[0].token_ids

    try:
        tokens = asyncio.run(asyncio.wait_for(body(), timeout=60))
        assert tokens == reference(llama).greedy(prompts[1], MAX_TOKENS)
        scheduler = engine.core.scheduler
        assert not scheduler.free_after_load and not scheduler.loading
        scheduler.kv_cache.assert_no_leaks()
    finally:
        engine.shutdown()


WRITER = """
import os, sys, signal
from treadle.config import EngineArgs
from treadle.kv_transfer import KVConnectorRole, create_connector
from treadle.kv_transfer.shared_storage import BlockTransfer
import torch

config = EngineArgs(model=sys.argv[1], kv_transfer_config={
    "kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
    "kv_connector_extra_config": {"shared_storage_path": sys.argv[2]}}).create_config()
worker = create_connector(config, KVConnectorRole.WORKER)
worker.register_kv_caches([torch.ones(2, 4, 16, 2, 16) for _ in range(3)])
real_fdopen = os.fdopen

def dying_fdopen(fd, mode):
    f = real_fdopen(fd, mode)
    real_write = f.write
    def write(data):
        real_write(data[:len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)   # the writer dies mid-write
    f.write = write
    return f

os.fdopen = dying_fdopen
worker._write_block(BlockTransfer("r", 1, sys.argv[3], 0))
"""


def test_a_writer_killed_mid_write_leaves_no_block_a_reader_loads(llama, tmp_path):
    key = "0" * 64
    proc = subprocess.run([sys.executable, "-c", WRITER, llama, str(tmp_path), key],
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (tmp_path / f"{key}.kv").exists()
    leftovers = list(tmp_path.glob(".tmp-*"))
    assert leftovers and all(os.path.getsize(f) > 0 for f in leftovers)
