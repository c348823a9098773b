"""KV tiers: the host-memory OffloadingConnector and MultiConnector, checked against
transformers with a device cache too small to keep the prompts, so that they come back from
the tier."""

from __future__ import annotations

import argparse
import http.client
import time

import pytest
import torch

from tests.kv_fixtures import BLOCK, MAX_TOKENS, connector_of, greedy, kv_config, prompts  # noqa: F401
from tests.reference import HFReference
from tests.test_server import MODEL, Server
from treadle import LLM
from treadle.config import EngineArgs
from treadle.entrypoints.engine_cli_args import add_engine_args, engine_args_from

NUM_KV_BLOCKS = 10   # 144 tokens: one long prompt at a time, so each evicts the one before


def offload_config(num_blocks: int, block_bytes: int, policy: str = "recompute", **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"cpu_bytes_to_use": num_blocks * block_bytes, **extra}}


@pytest.fixture(scope="module")
def block_bytes(llama) -> int:
    config = EngineArgs(model=llama, block_size=BLOCK).create_config()
    return config.cache.bytes_per_block(config.model)


def tier_llm(llama, kv_transfer_config: dict, **kw) -> LLM:
    return LLM(llama, block_size=BLOCK, num_kv_blocks=NUM_KV_BLOCKS,
               kv_transfer_config=kv_transfer_config, **kw)


def run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return outs


def tier_stats(llm: LLM, i: int = 0):
    return llm.get_stats().kv_tiers[i]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefixes_evicted_from_the_device_come_back_from_the_tier_exactly(
        llama, reference, prompts, block_bytes, async_scheduling):
    llm = tier_llm(llama, offload_config(64, block_bytes), async_scheduling=async_scheduling)
    ref = reference(llama)
    first = run(llm, prompts)
    assert tier_stats(llm).hits == 0 and tier_stats(llm).bytes_saved > 0
    # Turn two: each prompt again, then with its answer and more text; the device cache has
    # held only the last one, so every other comes back from the tier.
    turns = prompts + [p + list(o.outputs[0].token_ids) + prompts[3] for p, o in zip(prompts, first)]
    outs = run(llm, turns)
    assert [o.outputs[0].token_ids for o in outs] == [ref.greedy(p, MAX_TOKENS) for p in turns]
    stats = tier_stats(llm)
    assert stats.hits > 0 and stats.bytes_loaded == stats.hits * block_bytes
    assert stats.failed_loads == 0 and stats.evictions == 0
    assert outs[0].num_cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
    worker = connector_of(llm)
    assert worker.num_loaded_blocks == stats.hits
    # A save is counted as the workers report it done, a step after it (the saver thread's):
    # the last step's, once another step has run.
    run(llm, [[5, 6, 7]])
    stats = tier_stats(llm)
    assert worker.num_saved_blocks * block_bytes == stats.bytes_saved == stats.bytes_stored


def test_lru_eviction_stays_within_the_budget(llama, reference, prompts, block_bytes):
    budget_blocks = 5   # one long prompt's blocks
    llm = tier_llm(llama, offload_config(budget_blocks, block_bytes))
    ref = reference(llama)
    long, short = prompts[0], prompts[1]
    for p in (short, long, short, long):   # short, then long evicts it
        out = run(llm, [p])[0]
        assert out.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS)
        stats = tier_stats(llm)
        assert stats.bytes_stored <= stats.capacity_bytes == budget_blocks * block_bytes
    stats = tier_stats(llm)
    assert stats.evictions > 0
    assert connector_of(llm).store.peak_bytes <= budget_blocks * block_bytes
    # The long prompt, most recent, is held, and of its 7 blocks the tier kept the first 4:
    # tails go first (the 7th, saved last, is held too, but after a gap).
    llm.reset_prefix_cache()
    hits = tier_stats(llm).hits
    out = run(llm, [long])[0]
    assert tier_stats(llm).hits - hits == budget_blocks - 1
    assert out.num_cached_tokens == (budget_blocks - 1) * BLOCK
    assert out.outputs[0].token_ids == ref.greedy(long, MAX_TOKENS)


def test_kv_of_old_weights_is_never_hit_after_an_update(llama, prompts, block_bytes):
    llm = tier_llm(llama, offload_config(64, block_bytes))
    run(llm, [prompts[0]])
    name = "model.layers.0.input_layernorm.weight"
    weight = dict(llm.collective_rpc(lambda w: dict(w.runner.model.named_parameters()))[0])[name]
    new = [(name, weight.detach().clone() * 1.5)]
    llm.update_weights(new, weight_version="v2")
    out = run(llm, [prompts[0]])[0]
    assert tier_stats(llm).hits == 0, "KV computed with the old weights was loaded"
    assert out.outputs[0].token_ids == HFReference(llama, overrides=new).greedy(prompts[0], MAX_TOKENS)
    assert llm.reset_prefix_cache()   # out of the device cache
    out = run(llm, [prompts[0]])[0]
    assert tier_stats(llm).hits > 0   # its KV under the new weights' keys


def damage_tier(llm: LLM) -> None:
    store = connector_of(llm).store
    store.buffer.view(torch.uint8)[..., :8] ^= 0xFF


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_damaged_block_fails_its_load(llama, reference, prompts, block_bytes, policy):
    llm = tier_llm(llama, offload_config(64, block_bytes, policy))
    ref = reference(llama)
    run(llm, [prompts[0]])
    damage_tier(llm)
    assert llm.reset_prefix_cache()
    out = run(llm, [prompts[0]])[0].outputs[0]
    assert tier_stats(llm).failed_loads > 0
    if policy == "recompute":
        assert out.token_ids == ref.greedy(prompts[0], MAX_TOKENS)
        assert tier_stats(llm).bytes_loaded == 0
    else:
        assert out.finish_reason == "error" and out.token_ids == []
        assert "KV block 0" in out.stop_reason and "failed to load" in out.stop_reason
    # The damaged keys were forgotten: the prompt again is computed and stored anew, exactly.
    assert llm.reset_prefix_cache()
    again = run(llm, [prompts[0]])[0].outputs[0]
    assert again.token_ids == ref.greedy(prompts[0], MAX_TOKENS)


def test_injected_failures_under_recompute_are_exact(llama, reference, prompts, block_bytes):
    llm = tier_llm(llama, offload_config(64, block_bytes, inject_load_failure_rate=0.3,
                                         inject_seed=1))
    ref = reference(llama)
    run(llm, prompts)
    outs = run(llm, prompts * 2)
    assert [o.outputs[0].token_ids for o in outs] == [ref.greedy(p, MAX_TOKENS) for p in prompts * 2]
    assert tier_stats(llm).failed_loads > 0 and tier_stats(llm).bytes_loaded > 0


def test_multi_connector_serves_from_the_second_tier_when_the_first_misses(
        llama, reference, prompts, block_bytes, tmp_path):
    config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"connectors": [
                  offload_config(7, block_bytes), kv_config(tmp_path, "kv_both")]}}
    llm = tier_llm(llama, config)
    ref = reference(llama)
    long = prompts[0]
    num_blocks = (len(long) - 1) // BLOCK
    # The host tier holds one long prompt's blocks: the other's evict the first's.
    run(llm, [long, long[::-1]])
    host, files = tier_stats(llm, 0), tier_stats(llm, 1)
    assert (host.connector, files.connector) == ("OffloadingConnector", "SharedStorageConnector")
    assert host.evictions > 0 and files.bytes_saved > host.bytes_stored
    assert llm.reset_prefix_cache()
    out = run(llm, [long])[0]
    assert out.outputs[0].token_ids == ref.greedy(long, MAX_TOKENS)
    host, files = tier_stats(llm, 0), tier_stats(llm, 1)
    assert files.hits == num_blocks and host.hits == 0
    # Loaded from the files, saved into host memory: next time the first tier serves it.
    assert llm.reset_prefix_cache()
    out = run(llm, [long])[0]
    assert out.outputs[0].token_ids == ref.greedy(long, MAX_TOKENS)
    assert tier_stats(llm, 0).hits == num_blocks and tier_stats(llm, 1).hits == num_blocks
    # A fresh engine on the same folder loads from the second tier only.
    fresh = tier_llm(llama, config)
    outs = run(fresh, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [ref.greedy(p, MAX_TOKENS) for p in prompts]
    assert tier_stats(fresh, 1).hits > 0 and tier_stats(fresh, 0).hits == 0


def test_the_host_tier_after_another_connector_stores_only_its_own_kv(llama, tmp_path,
                                                                      block_bytes, monkeypatch):
    """MultiConnector ran each connector's loads in turn, and only the host tier's own waited
    for its saves, which copy on a thread of their own: with the tier listed second, the
    storage connector loaded B's KV into blocks A had just left while the tier still copied
    A's out of them, and the tier kept B's KV under A's keys (a helper's find). A slow copy
    stands in for a busy host."""
    from treadle import SamplingParams
    from treadle.kv_transfer.host_store import HostMemoryStore

    store = tmp_path / "kv"
    a, b = list(range(1000, 1000 + 3 * BLOCK + 1)), list(range(3000, 3000 + 3 * BLOCK + 1))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    producer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(store, "kv_producer"))
    producer.generate([{"prompt_token_ids": b}], one, use_tqdm=False)   # B's KV in the store
    del producer

    put = HostMemoryStore.put
    monkeypatch.setattr(HostMemoryStore, "put", lambda *args: time.sleep(0.3) or put(*args))
    tiers = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [
                 kv_config(store, "kv_consumer"),
                 {"kv_connector": "OffloadingConnector",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 32 * block_bytes}}]}}
    llm = LLM(llama, block_size=BLOCK, num_kv_blocks=6, max_model_len=80, kv_transfer_config=tiers)
    for rid, prompt in (("A", a), ("B", b)):   # B loads into the blocks A leaves
        llm.engine.add_request(rid, {"prompt_token_ids": prompt}, one)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    monkeypatch.setattr(HostMemoryStore, "put", put)
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": a}], greedy(4), use_tqdm=False)[0]   # from the tier
    assert out.num_cached_tokens == 3 * BLOCK
    assert out.outputs[0].token_ids == HFReference(llama).greedy(a, 4)


def test_stats_reach_metrics_of_a_real_server(llama, tmp_path):
    server = Server(llama, tmp_path, "--kv-offloading-size", "0.01")
    try:
        client = server.client()
        text = "The capital of France is a city that many people like to visit. " * 6
        client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
        # Out of the device cache; the tier still has it.
        assert server.request("POST", "/reset_prefix_cache") == (200, {"success": True})
        client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    finally:
        assert server.stop() == 0
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
             if line.startswith("treadle:kv_tier")}
    label = '{connector="OffloadingConnector"}'
    assert lines[f"treadle:kv_tier_hits_total{label}"] > 0
    assert lines[f"treadle:kv_tier_loaded_bytes_total{label}"] > 0
    assert lines[f"treadle:kv_tier_saved_bytes_total{label}"] > 0
    assert lines[f"treadle:kv_tier_capacity_bytes{label}"] == int(0.01 * 2**30)
    assert f"treadle:kv_tier_evictions_total{label}" in lines


def test_a_prefix_hot_in_the_device_cache_is_the_last_the_tier_evicts(llama, block_bytes):
    """Blocks the device's prefix cache serves are touched in the tier's LRU too, so that the
    tier keeps a hot prefix for when the device's cache lets it go."""
    a, b, c = ([t + 200 * i for t in range(100, 164)] for i in range(3))   # 4 blocks each
    with LLM(llama, block_size=BLOCK, kv_transfer_config=offload_config(8, block_bytes)) as llm:
        index = llm.engine.core.scheduler.connector.index
        run(llm, [a])
        keys_a = set(index._keys)
        run(llm, [b])
        keys_b = set(index._keys) - keys_a
        assert len(keys_a) == len(keys_b) == 4
        run(llm, [a])   # its first 3 blocks from the device's prefix cache, the 4th recomputed
        assert tier_stats(llm).hits == 0
        run(llm, [c])   # 4 more blocks: the tier evicts 4
        assert keys_a <= set(index._keys) and not keys_b & set(index._keys)


# -- configuration ------------------------------------------------------------------------
def test_the_shorthand_builds_an_offloading_config(llama):
    config = EngineArgs(model=llama, kv_offloading_size=0.5).create_config().kv_transfer
    assert (config.kv_connector, config.kv_role) == ("OffloadingConnector", "kv_both")
    assert config.kv_connector_extra_config == {"cpu_bytes_to_use": 2**29}
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--kv-offloading-size", "2"]))[
        "kv_offloading_size"] == 2.0


@pytest.mark.parametrize("args, message", [
    ({"kv_offloading_size": 0}, "kv_offloading_size must be a size in GiB > 0"),
    ({"kv_offloading_size": -1.5}, "kv_offloading_size must be a size in GiB > 0"),
    ({"kv_offloading_size": "4"}, "kv_offloading_size must be a size in GiB > 0"),
    ({"kv_offloading_size": 1, "kv_transfer_config": {"kv_connector": "OffloadingConnector"}},
     "kv_offloading_size or kv_transfer_config, not both"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "needs cpu_bytes_to_use"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": -1}}},
     "cpu_bytes_to_use must be a number of bytes > 0"),
    ({"kv_offloading_size": 2**20}, r"size \(kv_offloading_size, or cpu_bytes_to_use in "
     r"kv_connector_extra_config\) is 1048576.00 GiB, more than the [0-9.]+ GiB of host memory "
     r"available now"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 2**62}}},
     "more than the [0-9.]+ GiB of host memory available now"),
    ({"kv_transfer_config": {"kv_connector": "MultiConnector",
                             "kv_connector_extra_config": {"connectors": []}}},
     "connectors must be a non-empty list"),
    ({"kv_transfer_config": {"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "OffloadingConnector"}]}}}, "needs cpu_bytes_to_use"),
])
def test_bad_tier_configs_are_refused_before_any_model_loads(tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tmp_path / "no-model"), **args).create_config()


def test_host_tiers_are_summed_against_the_memory_available(tmp_path):
    """Two host tiers in a MultiConnector, each 60% of what is available: refused together,
    once, before any model loads (a worker's check would count its own tier as taken)."""
    from treadle.config import available_memory_bytes

    each = int(0.6 * available_memory_bytes())
    tier = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": each}}
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [tier, tier]}}
    with pytest.raises(ValueError, match=rf"is {2 * each / 2**30:.2f} GiB, more than the"):
        EngineArgs(model=str(tmp_path / "no-model"), kv_transfer_config=multi).create_config()


def test_a_budget_under_one_block_is_refused(llama, block_bytes):
    with pytest.raises(ValueError, match="must hold at least one KV block"):
        tier_llm(llama, offload_config(1, block_bytes - 1))


def test_a_multi_turn_chat_past_the_device_cache_comes_back_from_the_tier(
        llama, reference, prompts, block_bytes):
    """Three conversations of four turns in turn, each prompt its whole history: together they
    outgrow the device cache (10 blocks), so a conversation coming back finds most of its
    history only in the tier, and every answer is transformers'."""
    llm = tier_llm(llama, offload_config(64, block_bytes))
    ref = reference(llama)
    pool = prompts[0]
    # Conversation c says pool rotated by 7c: a first turn of 40 tokens, then 16 a turn.
    streams = [pool[7 * c:] + pool[:7 * c] for c in range(3)]
    histories: list[list[int]] = [[] for _ in streams]
    from_tier = 0
    for turn in range(4):
        for c, stream in enumerate(streams):
            start = 0 if turn == 0 else 40 + 16 * (turn - 1)
            prompt = histories[c] + stream[start:40 + 16 * turn]
            hits, local = tier_stats(llm).hits, llm.get_stats().prefix_cache_hits
            out = run(llm, [prompt])[0]
            answer = list(out.outputs[0].token_ids)
            assert answer == ref.greedy(prompt, MAX_TOKENS)
            loaded = (tier_stats(llm).hits - hits) * BLOCK
            if turn > 0:
                # Its whole history but the last answer token (never computed) is cached: what
                # the device cache lost since, the tier has.
                computed = len(histories[c]) - 1
                assert out.num_cached_tokens == computed // BLOCK * BLOCK, (turn, c)
                assert llm.get_stats().prefix_cache_hits - local + loaded == out.num_cached_tokens
                if c == 0:   # the other two have run since: they evicted its tail at least
                    assert loaded > 0, turn
            from_tier += loaded
            histories[c] = prompt + answer
    stats = tier_stats(llm)
    assert sum(map(len, histories)) > 2 * NUM_KV_BLOCKS * BLOCK   # the working set outgrew it
    assert from_tier > sum(map(len, histories)) // 2
    assert stats.evictions == 0 and stats.failed_loads == 0
    assert stats.bytes_loaded == stats.hits * block_bytes


@pytest.mark.parametrize("load_async", [False, True])
def test_a_chain_about_to_be_loaded_loses_its_tail_first(llama, block_bytes, load_async):
    """Blocks about to be read are the most recently used, the head of a chain most of all.
    They were touched head first, so a chain's head went first and its tail was left with no
    way to reach it; blocks read asynchronously were not touched at all."""
    from treadle.kv_transfer.block_store import BlockTransfer

    llm = tier_llm(llama, offload_config(3, block_bytes))
    tier = llm.engine.core.connector   # the scheduler's side
    assert not tier.index.add("other") and not tier.index.add("head") and not tier.index.add("tail")
    loads = [BlockTransfer("r", 1, "head", 0), BlockTransfer("r", 2, "tail", 1)]
    if load_async:
        tier._async_loads = {"r": loads}
    else:
        tier._loads = loads
    tier._new_metadata()
    tier._loads, tier._async_loads = [], {}
    assert tier.index.add("new") == ["other"]   # the least recently used
    assert tier.index.add("newer") == ["tail"]   # then the chain's tail, before its head
