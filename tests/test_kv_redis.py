"""RedisConnector against a real redis-server (started here on a free port, stopped at the
end): engines share blocks through it exactly, never across models or weights, and survive it
being down, killed and restarted."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time

import pytest

from tests.kv_fixtures import BLOCK, MAX_TOKENS, connector_of, greedy, prompts  # noqa: F401
from tests.redis_server import RedisServer, free_port
from tests.test_kv_offloading import block_bytes, offload_config  # noqa: F401
from tests.test_server import MODEL, Server
from tests.tiny_models import tiny_checkpoint_dir
from treadle import LLM
from treadle.config import EngineArgs
from treadle.metrics import _kv_tier_metrics

RETRY_S = 0.2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_db(server):
    """The server, emptied for the test."""
    if server.proc is None:
        server.start()
    server.client().flushall()
    return server


def redis_config(url: str, policy: str = "recompute", **extra) -> dict:
    return {"kv_connector": "RedisConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"url": url, "retry_interval_s": RETRY_S, **extra}}


def redis_llm(model: str, config: dict, **kw) -> LLM:
    return LLM(model, block_size=BLOCK, kv_transfer_config=config, **kw)


def run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def stats(llm: LLM, i: int = 0):
    return llm.get_stats().kv_tiers[i]


def test_two_instances_share_blocks_exactly(llama, reference, prompts, redis_db):
    ref = reference(llama)
    expected = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    first = redis_llm(llama, redis_config(redis_db.url, ttl_s=600))
    assert tokens(run(first, prompts)) == expected
    connector_of(first).flush()
    run(first, [[5, 6, 7]])   # a step that brings the workers' reports of the saves
    assert stats(first).hits == 0 and stats(first).bytes_saved > 0
    # Every value is checksummed and expires (ttl_s); nothing of another kind is stored.
    client = redis_db.client()
    names = client.keys("treadle:kv:*")
    assert len(names) == connector_of(first).num_saved_blocks > 0
    assert all(0 < client.pttl(n) <= 600_000 for n in names)

    second = redis_llm(llama, redis_config(redis_db.url))
    outs = run(second, prompts)
    assert tokens(outs) == expected
    s = stats(second)
    long_blocks = (len(prompts[0]) - 1) // BLOCK
    assert s.connector == "RedisConnector" and s.failed_loads == 0
    assert s.hits >= long_blocks and s.bytes_loaded == s.hits * second.engine.core.scheduler.connector.block_bytes
    assert outs[0].num_cached_tokens == long_blocks * BLOCK
    assert connector_of(second).num_loaded_blocks == s.hits
    metrics = {m.name: m for m in _kv_tier_metrics(second.get_stats())}
    assert metrics["treadle:kv_tier_hits"].samples[0].value == s.hits
    assert "treadle:kv_tier_dropped_saves" in metrics


def test_blocks_an_instance_hits_in_its_own_cache_do_not_expire_for_the_others(
        llama, prompts, redis_db):
    """A prefix served by the instance's prefix cache is never loaded from Redis (no GETEX
    renews it): the lookup renews it, so that it stays for other instances while it is hot."""
    llm = redis_llm(llama, redis_config(redis_db.url, ttl_s=600))
    run(llm, [prompts[0]])
    connector_of(llm).flush()
    client = redis_db.client()
    names = client.keys("treadle:kv:*")
    for name in names:   # as if saved long ago
        client.pexpire(name, 5_000)
    run(llm, [prompts[0]])   # its whole prompt from this instance's prefix cache
    assert stats(llm).hits == 0
    renewed = [n for n in names if client.pttl(n) > 500_000]
    # The prompt's blocks, up to the last token (which is always computed); the blocks of its
    # output are not looked up again.
    assert len(renewed) == (len(prompts[0]) - 1) // BLOCK > 0
    assert all(0 < client.pttl(n) <= 5_000 for n in set(names) - set(renewed))


def test_other_models_and_weights_never_hit_but_a_copy_does(
        llama, tiny_checkpoints, tmp_path_factory, tmp_path, reference, prompts, redis_db):
    producer = redis_llm(llama, redis_config(redis_db.url))
    run(producer, prompts)
    connector_of(producer).flush()
    # The same checkpoint at another path (another host's copy) shares the blocks.
    copy = shutil.copytree(llama, tmp_path / "copy")
    consumer = redis_llm(str(copy), redis_config(redis_db.url))
    assert tokens(run(consumer, prompts)) == [reference(llama).greedy(p, MAX_TOKENS) for p in prompts]
    assert stats(consumer).hits > 0
    # Same architecture, other weights; and another model: no hit, exact.
    perturbed = tiny_checkpoint_dir("llama", tmp_path_factory, seed=1)
    for model in (perturbed, tiny_checkpoints["qwen2"]):
        # The prompts (168 tokens) fit one step of 256 as they did the default 2,048; the
        # untied head's GEMM (49,152 rows) is warmed only up to the budget at start-up.
        llm = redis_llm(model, redis_config(redis_db.url), max_num_batched_tokens=256)
        outs = run(llm, prompts)
        assert stats(llm).hits == 0, f"{model} loaded another model's KV"
        assert tokens(outs) == [reference(model).greedy(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_redis_down_at_start_misses_and_drops_saves(llama, reference, prompts, tmp_path, policy,
                                                    caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"   # nobody listens
    llm = redis_llm(llama, redis_config(url, policy))
    start = time.monotonic()
    with caplog.at_level("WARNING"):
        outs = run(llm, prompts + prompts)
    assert time.monotonic() - start < 60
    assert tokens(outs) == [reference(llama).greedy(p, MAX_TOKENS) for p in prompts + prompts]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    s = stats(llm)
    assert s.hits == 0 and s.dropped_saves > 0
    # One warning per side for the outage, not one per block.
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert 1 <= len(unreachable) <= 2


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_loads_that_cannot_reach_redis_follow_the_policy(llama, reference, prompts, redis_db,
                                                         policy):
    producer = redis_llm(llama, redis_config(redis_db.url))
    run(producer, prompts)
    connector_of(producer).flush()
    llm = redis_llm(llama, redis_config(redis_db.url, policy))
    # The workers lose Redis after the scheduler looked it up (a partition, or Redis dying
    # in between): their loads fail.
    worker = connector_of(llm)
    worker.link.client.connection_pool.connection_kwargs["port"] = free_port()
    outs = run(llm, prompts)
    expected = [reference(llama).greedy(p, MAX_TOKENS) for p in prompts]
    loaded = [p for p in prompts if len(p) > BLOCK]
    assert stats(llm).failed_loads > 0 and stats(llm).bytes_loaded == 0
    if policy == "recompute":
        assert tokens(outs) == expected
    else:
        for p, out, exp in zip(prompts, outs, expected):
            o = out.outputs[0]
            if p in loaded:   # ended cleanly, on its own
                assert o.finish_reason == "error" and o.token_ids == []
                assert "failed to load" in o.stop_reason
            else:
                assert o.token_ids == exp
        # The engine goes on serving.
        assert tokens(run(llm, prompts[3:])) == expected[3:]


def test_redis_killed_mid_run_then_restarted(llama, reference, prompts, redis_db):
    ref = reference(llama)
    expected = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    llm = redis_llm(llama, redis_config(redis_db.url))
    assert tokens(run(llm, prompts)) == expected
    connector_of(llm).flush()
    redis_db.stop()
    assert llm.reset_prefix_cache()
    start = time.monotonic()
    assert tokens(run(llm, prompts)) == expected   # misses or failed loads: recomputed
    assert time.monotonic() - start < 60
    # Blocks computed while it was down are dropped and counted.
    assert llm.reset_prefix_cache()
    assert tokens(run(llm, [prompts[0][::-1]])) == [ref.greedy(prompts[0][::-1], MAX_TOKENS)]
    connector_of(llm).flush()
    run(llm, [prompts[3]])   # a step reports what the saver dropped since
    assert stats(llm).dropped_saves > 0
    # Restarted (empty: no persistence): saves land again, then hits.
    redis_db.start()
    time.sleep(2 * RETRY_S)
    assert llm.reset_prefix_cache()
    hits = stats(llm).hits
    run(llm, prompts)
    connector_of(llm).flush()
    assert redis_db.client().dbsize() > 0
    assert llm.reset_prefix_cache()
    outs = run(llm, prompts)
    assert tokens(outs) == expected
    assert stats(llm).hits > hits and outs[0].num_cached_tokens > 0


@pytest.mark.parametrize("damage", ["a_flipped_byte", "another_type"])
def test_a_damaged_value_fails_its_load_and_is_recomputed(llama, reference, prompts, redis_db,
                                                         damage):
    """A flipped byte fails the block's checksum; a value of another type under its name (a
    list: another program's, or a key_prefix shared by mistake) fails its GET, and was once
    kept, so that every later load of it failed too (saves are SET NX)."""
    llm = redis_llm(llama, redis_config(redis_db.url))
    run(llm, [prompts[0]])
    connector_of(llm).flush()
    client = redis_db.client()
    names = client.keys("treadle:kv:*")
    for name in names:
        value = bytearray(client.get(name))
        if damage == "a_flipped_byte":
            value[-4] ^= 0xFF
            client.set(name, bytes(value))
        else:
            client.delete(name)
            client.rpush(name, b"not a block")
    expected = reference(llama).greedy(prompts[0], MAX_TOKENS)
    assert llm.reset_prefix_cache()
    out = run(llm, [prompts[0]])[0]
    assert out.outputs[0].token_ids == expected
    failed, hits = stats(llm).failed_loads, stats(llm).hits
    assert failed > 0
    # The damaged values were dropped, and the recomputed blocks saved in their place.
    connector_of(llm).flush()
    assert llm.reset_prefix_cache()
    out = run(llm, [prompts[0]])[0]
    assert out.outputs[0].token_ids == expected
    assert stats(llm).failed_loads == failed and stats(llm).hits > hits


def test_saves_past_the_queue_are_dropped_and_counted(llama, prompts, redis_db):
    llm = redis_llm(llama, redis_config(redis_db.url, max_pending_saves=1))
    worker = connector_of(llm)
    release = threading.Event()
    write = worker._write
    worker._write = lambda batch: (release.wait(30), write(batch))   # a slow Redis
    run(llm, prompts)
    release.set()
    worker.flush()
    run(llm, [[5, 6, 7]])   # a step that brings the workers' reports of the saves
    s = stats(llm)
    assert s.dropped_saves > 0
    assert s.bytes_saved == worker.num_saved_blocks * llm.engine.core.scheduler.connector.block_bytes


def test_host_tier_then_redis(llama, reference, prompts, block_bytes, redis_db):
    config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"connectors": [
                  offload_config(7, block_bytes), redis_config(redis_db.url)]}}
    llm = redis_llm(llama, config, num_kv_blocks=10)
    ref = reference(llama)
    long = prompts[0]
    num_blocks = (len(long) - 1) // BLOCK
    # The host tier holds one long prompt: the reversed one evicts the first from it.
    run(llm, [long, long[::-1]])
    llm.engine.core.executor.worker.runner.connector.connectors[1].flush()
    host, remote = stats(llm, 0), stats(llm, 1)
    assert (host.connector, remote.connector) == ("OffloadingConnector", "RedisConnector")
    assert host.evictions > 0
    assert llm.reset_prefix_cache()
    out = run(llm, [long])[0]
    assert out.outputs[0].token_ids == ref.greedy(long, MAX_TOKENS)
    assert stats(llm, 1).hits == num_blocks and stats(llm, 0).hits == 0


@pytest.mark.parametrize("extra, message", [
    ({"url": "http://localhost:6379"}, "url must be redis://"),
    ({"url": "redis://localhost", "ttl_s": 0}, "ttl_s must be a number of seconds > 0"),
    ({"url": "redis://localhost", "timeout_s": "1"}, "timeout_s must be a number"),
    ({"url": "redis://localhost", "max_pending_saves": 0}, "max_pending_saves must be an int"),
    ({}, "needs url"),
])
def test_bad_redis_configs_are_refused_before_any_model_loads(tmp_path, extra, message):
    config = {"kv_connector": "RedisConnector", "kv_connector_extra_config": extra}
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tmp_path / "no-model"), kv_transfer_config=config).create_config()


def test_two_servers_share_prefixes_through_one_redis(llama, reference, prompts, redis_db,
                                                      tmp_path):
    """Two `treadle serve` processes, one Redis: the second loads the KV the first computed,
    and answers exactly as transformers does."""
    ref = reference(llama)
    expected = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    flag = ("--kv-transfer-config", json.dumps(redis_config(redis_db.url)))

    def complete(server: Server, prompt: list[int]) -> tuple[list[int], int]:
        status, body = server.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert status == 200, body
        return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def tier_hits(server: Server) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        line = next(l for l in text.splitlines()
                    if l.startswith('treadle:kv_tier_hits_total{connector="RedisConnector"}'))
        return float(line.split()[-1])

    long_blocks = (len(prompts[0]) - 1) // BLOCK
    first = Server(llama, tmp_path, *flag)
    try:
        assert [complete(first, p)[0] for p in prompts] == expected
        assert tier_hits(first) == 0
        # The saver writes on its own thread: wait until the long prompt's blocks are all in.
        client, deadline = redis_db.client(), time.monotonic() + 30
        while client.dbsize() < long_blocks:
            assert time.monotonic() < deadline, "the first server's blocks never reached Redis"
            time.sleep(0.05)
    finally:
        assert first.stop() == 0
    second = Server(llama, tmp_path, *flag)
    try:
        answers = [complete(second, p) for p in prompts]
        assert [ids for ids, _ in answers] == expected
        assert answers[0][1] == long_blocks * BLOCK   # the whole long prompt but its last token
        assert tier_hits(second) >= long_blocks
    finally:
        assert second.stop() == 0


def test_two_tiers_of_one_class_count_and_show_apart(llama, prompts, redis_db):
    """A local Redis that is up and a shared one that is down, in one MultiConnector: dropped
    saves came back from the workers keyed by class name, the down one's charged to the one
    that is up, and /metrics gave both one label set (duplicate series in a family)."""
    down = f"redis://127.0.0.1:{free_port()}/0"   # nobody listens: its saves are all dropped
    tiers = [{"kv_connector": "RedisConnector",
              "kv_connector_extra_config": {"url": url, "retry_interval_s": RETRY_S}}
             for url in (redis_db.url, down)]
    llm = redis_llm(llama, {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"connectors": tiers}})
    run(llm, prompts[:3])
    for c in connector_of(llm).connectors:
        c.flush()
    run(llm, [prompts[3]])   # its step brings the workers' reports of dropped saves
    up, lost = llm.get_stats().kv_tiers
    assert (up.connector, lost.connector) == ("RedisConnector", "RedisConnector#2")
    assert lost.dropped_saves > 0 and up.dropped_saves == 0 and up.bytes_saved > 0
    hits = [m for m in _kv_tier_metrics(llm.get_stats()) if m.name == "treadle:kv_tier_hits"]
    assert [s.labels["connector"] for s in hits[0].samples if s.name.endswith("_total")] == \
        ["RedisConnector", "RedisConnector#2"]


def test_a_waiting_request_renews_the_head_it_hits_here_once(llama, redis_db):
    """A request waiting for room is looked up again every step. The head this instance's
    prefix cache serves it is renewed at the first of those lookups, and again only if that
    hit grows, not once a step: for a long system prompt that is thousands of PEXPIREs a step."""
    a = list(range(100, 228))              # 8 blocks
    b = a[:48] + list(range(300, 348))     # a's first 3 blocks, then 3 of its own
    llm = redis_llm(llama, redis_config(redis_db.url, ttl_s=600), num_kv_blocks=11)
    client = redis_db.client()
    client.config_resetstat()
    lookups = []
    scheduler_side = llm.engine.core.scheduler.connector
    lookup = scheduler_side._lookup
    scheduler_side._lookup = lambda *args: lookups.append(args[1:]) or lookup(*args)
    outs = llm.generate([{"prompt_token_ids": p} for p in (a, b)], greedy(24), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]
    waiting = [kept for first, _, kept in lookups if first == 3]
    assert len(waiting) > 5 and waiting[0] and not any(waiting[1:])   # b waited a while
    pexpires = client.info("commandstats").get("cmdstat_pexpire", {}).get("calls", 0)
    assert pexpires == 3
