"""KV connectors under the engine's controls: resets, pauses and sleeps with asynchronous loads,
request ids reused while a load is in flight, a connector that asks to be asked again, prompt
logprobs, and weight changes. Every output is checked against transformers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.kv_fixtures import (BLOCK, MAX_TOKENS, connector_of, copy_store, core_request, greedy,
                               kv_config, prompts, store)  # noqa: F401 (fixtures)
from tests.reference import HFReference
from treadle import LLM, SamplingParams
from treadle.kv_transfer import register_connector
from treadle.kv_transfer.shared_storage import SharedStorageConnector


def steps_until(llm: LLM, done, limit: int = 500) -> dict:
    """Step the engine until `done()`; returns the finished outputs by request id."""
    finals = {}
    for _ in range(limit):
        if done():
            return finals
        finals.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    raise AssertionError("the engine made no progress")


def finish(llm: LLM, finals: dict) -> dict:
    finals.update(steps_until(llm, lambda: not llm.engine.has_unfinished_requests()))
    llm.engine.core.drain()
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return finals


# -- defect 1: a reset, pause(keep) or sleep, then an asynchronous load ------------------------
@pytest.mark.parametrize("control", ["reset", "pause_keep", "sleep"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_reset_request_reloads_asynchronously_and_ends_exact(llama, reference, prompts, store,
                                                                tmp_path, control,
                                                                async_scheduling):
    """The running request is reset, so its next admission loads its prompt asynchronously
    again. The connector used to drop the tracking that admission made (the request was in the
    step's finished ids), and the engine died with a KeyError when the load was done."""
    llm = LLM(llama, block_size=BLOCK, async_scheduling=async_scheduling,
              kv_transfer_config=kv_config(copy_store(store, tmp_path), "kv_both",
                                           load_async=True))
    core = llm.engine.core
    llm.engine.add_request("r", {"prompt_token_ids": prompts[0]}, greedy())
    finals = steps_until(llm, lambda: core.scheduler.running)
    if control == "reset":
        assert core.reset_prefix_cache(reset_running_requests=True)
    elif control == "pause_keep":
        core.pause(mode="keep")
        core.resume()
    else:
        core.pause(mode="keep", clear_cache=False)
        core.sleep(level=1)
        core.wake_up()
        core.resume()
    assert core_request(llm.engine, "r").num_computed_tokens == 0
    steps_until(llm, lambda: core.scheduler.loading)   # loading its prompt again
    finals = finish(llm, finals)
    assert finals["r"].outputs[0].token_ids == reference(llama).greedy(prompts[0], MAX_TOKENS)
    assert connector_of(llm).num_loaded_blocks >= 2 * (len(prompts[0]) // BLOCK)


# -- defect 2: a reused id takes over the old request's load -----------------------------------
def test_a_reused_id_does_not_take_the_aborted_requests_load(llama, reference, prompts, store,
                                                             tmp_path):
    """Old "R" loads two good blocks in step N; it is aborted while N runs, and a new "R" (a
    longer prompt) is admitted at once in step N+1, loading blocks of which the third fails.
    Settling N used to match the new R (same id, no preemption either) and publish all of its
    blocks, the bad one included, before N+1's load failure was heard: the new R's recompute
    then read the bad block from its own prefix cache."""
    llm = LLM(llama, block_size=BLOCK, async_scheduling=True,
              kv_transfer_config=kv_config(copy_store(store, tmp_path), "kv_both",
                                           inject_failed_block_indices=[2]))
    core = llm.engine.core
    old, new = prompts[1], prompts[0]   # blocks 0-1 stored; blocks 0-4 stored, block 2 fails
    assert (len(old) - 1) // BLOCK == 2 and (len(new) - 1) // BLOCK >= 3
    llm.engine.add_request("R", {"prompt_token_ids": old}, greedy())
    llm.engine.step()                                   # step N: old R loads, still in flight
    assert core.batch_queue and core.batch_queue[0][1].kv_loads
    llm.engine.abort_request("R")
    llm.engine.add_request("R", {"prompt_token_ids": new}, greedy())
    finals = finish(llm, {})
    expected = reference(llama).greedy(new, MAX_TOKENS)
    assert finals["R"].outputs[0].token_ids == expected
    assert connector_of(llm).num_failed_loads >= 1
    # Nothing bad stayed published either: a later request with that prompt hits and is exact.
    outs = llm.generate([{"prompt_token_ids": new}], greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected


def test_an_id_aborted_during_its_asynchronous_load_is_free_at_once(llama, reference, prompts,
                                                                    store, tmp_path):
    """Ids are the client's (invariant 6). "R" is aborted while its KV still loads
    asynchronously into blocks it holds; a new "R" sent at once used to be refused ("already
    in use") until the old load ended. Now it runs beside the old load and is exact."""
    llm = LLM(llama, block_size=BLOCK,
              kv_transfer_config=kv_config(copy_store(store, tmp_path), "kv_both",
                                           load_async=True, inject_load_delay_s=0.5))
    core = llm.engine.core
    llm.engine.add_request("R", {"prompt_token_ids": prompts[0]}, greedy())
    llm.engine.step()
    assert core.scheduler.loading
    finals = llm.engine.abort_request("R")
    assert [o.outputs[0].finish_reason for o in finals] == ["abort"]
    llm.engine.add_request("R", {"prompt_token_ids": prompts[0]}, greedy())
    assert core.scheduler.free_after_load   # the old load still runs
    finals = finish(llm, {})
    assert finals["R"].outputs[0].token_ids == reference(llama).greedy(prompts[0], MAX_TOKENS)


def test_an_abort_during_an_asynchronous_load_is_done_when_the_engine_says(llama, prompts,
                                                                          store, tmp_path):
    """`while engine.has_unfinished_requests(): engine.step()` (LLM.generate's loop) ended
    while the aborted request's load still held its blocks: they stayed held until some later
    request made the engine step."""
    llm = LLM(llama, block_size=BLOCK,
              kv_transfer_config=kv_config(copy_store(store, tmp_path), "kv_both",
                                           load_async=True, inject_load_delay_s=0.3))
    llm.engine.add_request("R", {"prompt_token_ids": prompts[0]}, greedy())
    llm.engine.step()
    assert llm.engine.core.scheduler.loading
    llm.engine.abort_request("R")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.get_stats().kv_cache_usage == 0.0
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()


# -- defect 3's second trigger: a connector that cannot tell yet -------------------------------
class SlowLookupConnector(SharedStorageConnector):
    """Answers "ask again later" to the first three lookups of each request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_asked: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = self.num_asked[request.request_id] = self.num_asked.get(request.request_id, 0) + 1
        if n <= 3:
            return None, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


register_connector("SlowLookupConnector", f"{__name__}:SlowLookupConnector")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_connector_that_asks_to_be_asked_later_is_waited_for(llama, reference, prompts, store,
                                                               async_scheduling):
    config = kv_config(store, "kv_consumer")
    config["kv_connector"] = "SlowLookupConnector"
    llm = LLM(llama, block_size=BLOCK, async_scheduling=async_scheduling,
              kv_transfer_config=config)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference(llama).greedy(prompts[0], MAX_TOKENS)
    assert list(llm.engine.core.connector.num_asked.values()) == [4]
    assert connector_of(llm).num_loaded_blocks > 0
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()


# -- defect 7: prompt logprobs with a connector ------------------------------------------------
def test_prompt_logprobs_are_computed_for_every_position_with_a_connector(llama, reference,
                                                                          prompts, store):
    """Such a request skips the local prefix cache, and must skip the connector too: loaded
    positions are never computed, so their logprobs were None."""
    llm = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(store, "kv_consumer"))
    ids = prompts[0]
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert all(entry is not None for entry in out.prompt_logprobs[1:])
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    assert torch.allclose(got, reference(llama).prompt_logprobs(ids), atol=1e-4)
    assert connector_of(llm).num_loaded_blocks == 0


# -- the sleep: the connector lets go of the cache ------------------------------------------------
def test_sleep_frees_the_kv_cache_with_a_connector(llama, store):
    llm = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(store, "kv_consumer"))
    caches = [weakref.ref(c) for c in llm.engine.core.executor.worker.runner.kv_caches]
    llm.sleep(level=1)
    gc.collect()
    assert all(ref() is None for ref in caches), "a KV cache tensor outlived sleep()"
    llm.wake_up()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# -- defects 4 and 5: weights own their KV, in the store too ------------------------------------
WEIGHT = "model.layers.0.input_layernorm.weight"   # changes every layer's K/V


def weight_of(llm: LLM) -> torch.Tensor:
    return llm.collective_rpc(lambda worker: dict(
        worker.runner.model.named_parameters())[WEIGHT].detach().clone())[0]


@pytest.mark.parametrize("labels", [("step-1", None, None), ("v", "v"), (0, 0)])
def test_every_update_keys_the_store_anew_whatever_its_label(llama, reference, prompts,
                                                              tmp_path, labels):
    """Updates to other weights, labelled anyhow (a string then none, a label repeated, 0):
    each gives KV keys of its own. Instance i applies the first i updates and saves the
    prompt's KV; it must load none of what the earlier instances saved under other weights.
    An instance that applies the same updates as another does load its KV, exactly."""
    path = tmp_path / "kv"
    identities = []
    for i in range(1, len(labels) + 2):
        llm = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(path, "kv_both"))
        weight = weight_of(llm)
        for j in range(min(i, len(labels))):
            llm.update_weights([(WEIGHT, weight * (1.0 + 0.25 * (j + 1)))],
                               weight_version=labels[j])
        identities.append(llm.engine.core.weights.identity)
        out = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(), use_tqdm=False)[0]
        loaded = connector_of(llm).num_loaded_blocks
        if i <= len(labels):
            assert loaded == 0, f"after update {i} ({labels[:i]}), KV of other weights was loaded"
        else:   # the same updates as the instance before
            assert loaded == (len(prompts[0]) - 1) // BLOCK
            final = [(WEIGHT, weight * (1.0 + 0.25 * len(labels)))]
            expected = HFReference(llama, overrides=final).greedy(prompts[0], MAX_TOKENS)
            assert out.outputs[0].token_ids == expected
        del llm
    assert len(set(identities)) == len(labels) and identities[-1] == identities[-2]


def test_kv_computed_on_old_kv_after_an_update_while_kept_is_not_stored(llama, prompts, tmp_path):
    """pause(keep, clear_cache=False) mid-prefill, an update, resume: the kept request's later
    blocks sit on KV of the old weights. They used to be saved under the new weights' keys, and
    an instance loading them diverged from transformers on the new weights."""
    path = tmp_path / "kv"
    producer = LLM(llama, block_size=BLOCK, max_num_batched_tokens=BLOCK,
                   kv_transfer_config=kv_config(path, "kv_both"))
    core = producer.engine.core
    new_weight = weight_of(producer) * 1.5
    producer.engine.add_request("kept", {"prompt_token_ids": prompts[0]}, greedy())
    steps_until(producer, lambda: core.scheduler.running
                and core_request(producer.engine, "kept").num_computed_tokens >= 2 * BLOCK)
    core.pause(mode="keep", clear_cache=False)
    producer.update_weights([(WEIGHT, new_weight)], weight_version="v2")
    core.resume()
    finish(producer, {})

    consumer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(path, "kv_consumer"))
    consumer.update_weights([(WEIGHT, new_weight)], weight_version="v2")
    reference = HFReference(llama, overrides=[(WEIGHT, new_weight)])
    # Its first two blocks computed here, with the new weights: the store is asked from block 2.
    head = prompts[0][:2 * BLOCK + 1]
    consumer.generate([{"prompt_token_ids": head}], greedy(1), use_tqdm=False)
    out = consumer.generate([{"prompt_token_ids": prompts[0]}], greedy(), use_tqdm=False)[0]
    assert connector_of(consumer).num_loaded_blocks == 0, "blocks computed on old KV were stored"
    assert out.num_cached_tokens == 2 * BLOCK
    assert out.outputs[0].token_ids == reference.greedy(prompts[0], MAX_TOKENS)
