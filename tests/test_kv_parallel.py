"""KV connectors under pipeline and tensor parallelism (the mp executor): each rank saves and
loads its own part of every block, a block counts as loaded only when every rank loaded it,
and a failure on one rank cuts the request back exactly as on one worker."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.kv_fixtures import BLOCK, MAX_TOKENS, greedy, kv_config, prompts  # noqa: F401
from tests.redis_server import RedisServer
from tests.test_correctness import TEXTS
from tests.test_kv_offloading import block_bytes, offload_config  # noqa: F401
from tests.test_kv_redis import redis_config
from tests.test_weight_transfer import llama_tp3  # noqa: F401
from treadle import LLM
from treadle.config import EngineArgs
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.kv_transfer import KVConnectorOutput
from treadle.kv_transfer.aggregate import KVOutputAggregator
from treadle.models.loader import load_tokenizer

LAYOUTS = {"pp2": {"pipeline_parallel_size": 2}, "tp2": {"tensor_parallel_size": 2}}
# Every test's prompts (at most 168 tokens in all) fit one step of 256 tokens, as they did the
# default 2,048: each rank warms its GEMMs up to the budget at start-up, and a last stage's head
# (the tied embedding's copy, 49,152 rows) took most of a two-stage engine's start at 2,048.
STEP_BUDGET = {"max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def flush_redis(worker) -> None:
    """On a worker (collective_rpc): wait for its Redis saves to land."""
    worker.runner.connector.flush()


def flush_second_tier(worker) -> None:
    worker.runner.connector.connectors[1].flush()


def run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return outs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("connector", ["shared_storage", "offloading", "redis", "multi"])
def test_each_rank_moves_its_part_and_a_failure_on_one_rank_cuts_back(
        llama, reference, prompts, block_bytes, server, tmp_path, layout, connector):
    # Rank 1 alone fails every load of a request's second block.
    inject = {"inject_failed_block_indices": [1], "inject_failure_ranks": [1]}
    if connector == "shared_storage":
        config = kv_config(tmp_path, "kv_both", **inject)
    elif connector == "offloading":
        config = offload_config(64, block_bytes, **inject)
    else:
        server.client().flushall()
        config = redis_config(server.url, **inject)
        if connector == "multi":   # host memory, then Redis: the host tier serves the hits
            config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"connectors": [
                          offload_config(64, block_bytes, **inject), config]}}
    ref = reference(llama)
    expected = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    long = prompts[0]
    with LLM(llama, block_size=BLOCK, num_kv_blocks=64, distributed_executor_backend="mp",
             kv_transfer_config=config, **LAYOUTS[layout], **STEP_BUDGET) as llm:
        assert [o.outputs[0].token_ids for o in run(llm, prompts)] == expected
        # Each block is stored as two parts, one per rank, under names of their own.
        if connector in ("redis", "multi"):
            llm.collective_rpc(flush_redis if connector == "redis" else flush_second_tier)
            parts = Counter(n.split(b".L", 1)[1] for n in server.client().keys("treadle:kv:*"))
        elif connector == "shared_storage":
            parts = Counter(f.name.split(".", 1)[1] for f in tmp_path.glob("*.kv"))
        if connector in ("redis", "multi", "shared_storage"):
            assert len(parts) == 2 and len(set(parts.values())) == 1, parts
        before = llm.get_stats().kv_tiers[0]
        assert llm.reset_prefix_cache()
        outs = run(llm, [long])
        assert outs[0].outputs[0].token_ids == expected[0]
        tier = llm.get_stats().kv_tiers[0]
        hits, failed = tier.hits - before.hits, tier.failed_loads - before.failed_loads
        # Every block was a hit; the second failed on rank 1 only, so the request kept the
        # first and recomputed from there.
        assert hits == (len(long) - 1) // BLOCK and failed > 0
        assert outs[0].num_cached_tokens == BLOCK
        # The bytes the ranks loaded: rank 0 its part of every block, rank 1 its part of all
        # but the failed ones (the parts need not be halves: a stage's layers, a rank's heads).
        loaded = tier.bytes_loaded - before.bytes_loaded
        assert (hits - failed) * block_bytes < loaded < hits * block_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_block_missing_one_ranks_part_is_a_miss(llama, reference, prompts, tmp_path, layout):
    with LLM(llama, block_size=BLOCK, num_kv_blocks=64, distributed_executor_backend="mp",
             kv_transfer_config=kv_config(tmp_path, "kv_both"), **LAYOUTS[layout],
             **STEP_BUDGET) as llm:
        run(llm, [prompts[0]])
        files = sorted(tmp_path.glob("*.kv"))
        parts = {f.name.split(".", 1)[1] for f in files}
        assert len(parts) == 2, parts
        for f in files:
            if f.name.endswith(sorted(parts)[1]):
                f.unlink()
        assert llm.reset_prefix_cache()
        out = run(llm, [prompts[0]])[0]
        assert out.outputs[0].token_ids == reference(llama).greedy(prompts[0], MAX_TOKENS)
        assert llm.get_stats().kv_tiers[0].hits == 0 and out.num_cached_tokens == 0


def test_reports_of_ranks_are_united_across_steps():
    """A rank may report an asynchronous load done steps before another: the request is done
    with the last report, carrying every rank's load errors; a synchronous load's errors are
    its own step's alone."""
    def step(kv_loads: dict, *reports: KVConnectorOutput):
        so = SchedulerOutput.__new__(SchedulerOutput)
        so.kv_loads = kv_loads
        outs = [ModelRunnerOutput.empty() for _ in reports]
        for out, kv in zip(outs, reports):
            out.kv_connector_output = kv
        return agg.aggregate(so, outs, 1).kv_connector_output

    agg = KVOutputAggregator(2)
    first = step({"sync": (0, [3], 0)},
                 KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={3, 7}),
                 KVConnectorOutput(dropped_saves={"RedisConnector": 1},
                                   transferred={"RedisConnector": (100, 40)}))
    assert first.finished_recving == set() and first.invalid_block_ids == {3, 7}
    second = step({}, KVConnectorOutput(dropped_saves={"RedisConnector": 2},
                                        transferred={"RedisConnector": (10, 4)}),
                  KVConnectorOutput(finished_recving={"a"}, dropped_saves={"RedisConnector": 1},
                                    transferred={"RedisConnector": (20, 0)}))
    assert second.finished_recving == {"a"} and second.invalid_block_ids == {7}
    assert first.dropped_saves == {"RedisConnector": 1}
    assert first.transferred == {"RedisConnector": (100, 40)}
    # Each step's reports, every rank's summed.
    assert second.dropped_saves == {"RedisConnector": 3}
    assert second.transferred == {"RedisConnector": (30, 4)}


# -- three tensor shards, and failures at 30% on one rank ------------------------------------------
def tier_config(connector: str, url: str, path, block_bytes: int, **extra) -> dict:
    """Each connector kind on `path` (files) or `url` (Redis); the host tier holds everything."""
    if connector == "shared_storage":
        return kv_config(path, "kv_both", **extra)
    if connector == "offloading":
        return offload_config(64, block_bytes, **extra)
    if connector == "redis":
        return redis_config(url, **extra)
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [
                offload_config(64, block_bytes, **extra), kv_config(path, "kv_both", **extra)]}}


@pytest.fixture(scope="module")
def tp3_prompts(llama_tp3) -> list[list[int]]:
    tok = load_tokenizer(llama_tp3)
    long = tok.encode(" ".join(TEXTS))
    return [long, long[:40], tok.encode(TEXTS[2])]


PARALLEL_FAILURES = [(layout, c) for layout in ("tp3", "pp2")
                     for c in ("shared_storage", "offloading", "redis", "multi")]


@pytest.mark.parametrize("layout, connector", PARALLEL_FAILURES)
def test_failures_at_30_percent_on_one_rank_stay_exact(llama, llama_tp3, reference, prompts,
                                                       tp3_prompts, server, tmp_path, layout,
                                                       connector):
    """Three tensor shards with each connector kind, and two stages, the last rank failing 30%
    of its loads: a block counts as loaded only if every rank loaded it, and the output is
    transformers' on every pass."""
    model, texts = (llama_tp3, tp3_prompts) if layout == "tp3" else (llama, prompts)
    ranks = {"tp3": {"tensor_parallel_size": 3}, "pp2": {"pipeline_parallel_size": 2}}[layout]
    world = 3 if layout == "tp3" else 2
    config = EngineArgs(model=model, block_size=BLOCK).create_config()
    block = config.cache.bytes_per_block(config.model)
    server.client().flushall()
    kv = tier_config(connector, server.url, tmp_path, block, inject_load_failure_rate=0.3,
                     inject_seed=3, inject_failure_ranks=[world - 1])
    ref = reference(model)
    expected = [ref.greedy(p, MAX_TOKENS) for p in texts]
    with LLM(model, block_size=BLOCK, num_kv_blocks=64, distributed_executor_backend="mp",
             kv_transfer_config=kv, **ranks, **STEP_BUDGET) as llm:
        assert [o.outputs[0].token_ids for o in run(llm, texts)] == expected
        if connector == "redis":
            llm.collective_rpc(flush_redis)
            names = server.client().keys("treadle:kv:*")
            assert len(Counter(n.split(b".L", 1)[1] for n in names)) == world
        elif connector == "shared_storage":
            assert len({f.name.split(".", 1)[1] for f in tmp_path.glob("*.kv")}) == world
        for _ in range(3):   # out of the device cache: from the tier, with failures
            assert llm.reset_prefix_cache()
            assert [o.outputs[0].token_ids for o in run(llm, texts)] == expected
        tier = llm.get_stats().kv_tiers[0]
        assert tier.failed_loads > 0 and tier.bytes_loaded > 0, tier
