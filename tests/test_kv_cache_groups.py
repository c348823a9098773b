"""KV cache groups (core/kv_cache_groups.py): a model mixing full-attention and sliding-window
layers (Gemma 2/3) gives each kind of layer a block table of its own, so that its local layers'
blocks leave behind their window while the request runs and its global layers keep theirs.

The layout first (which layers share a table and a tensor); then the block manager with a
full-attention group beside windowed ones: a prefix hit every group agrees on, salted hashes,
and the ledger's random interleavings with the KV oracle reading every group's table; then tiny
Gemma 2 and Gemma 3 checkpoints whose prompts are several windows long, in a pool too small to
hold them whole: token-identical to transformers, with local blocks given back mid-request and
handed to another request, under chunked prefill, prefix hits, preemption, async scheduling and
n-gram drafts, and a KV cache smaller for the same work than one table for every layer.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from tests.family_support import PretrainedReference as Reference
from tests.kernel_support import needs_kernels
from tests.test_scheduler import BS, make_request, make_scheduler
from tests.test_token_ledger import random_drafts, run_random_requests
from tests.test_window_eviction import CheckedRunner, ledger_reach, long_prompts, longest_blocks, run_evicting
from tests.tiny_models import make_tiny_checkpoint
from treadle import LLM, SamplingParams
from treadle.config import EngineArgs, window_reach
from treadle.core.kv_cache_groups import kv_cache_groups, window_blocks
from treadle.core.kv_cache_manager import KVCacheManager, group_hash

W = 24
S, F = W, None   # a sliding-window layer's window, a full-attention layer's


# -- the layout ----------------------------------------------------------------------------

def test_layers_of_one_kind_make_one_group_with_a_tensor_each():
    for windows in ([F] * 4, [S] * 4):
        groups = kv_cache_groups(windows)
        assert groups.group_windows == (windows[0],) and not groups.is_hybrid
        assert groups.layer_group == (0,) * 4 and groups.layer_tensor == (0, 1, 2, 3)
        assert groups.group_size == 4


def test_mixed_layers_make_equal_groups_that_share_tensors():
    # Gemma 2: local and global alternate. Two groups of two layers; layer j of each shares tensor j.
    g2 = kv_cache_groups([S, F, S, F])
    assert g2.group_windows == (None, W) and g2.group_size == 2
    assert g2.layer_group == (1, 0, 1, 0) and g2.layer_tensor == (0, 0, 1, 1)
    # Gemma 3: five local layers to a global one; groups of one layer.
    g3 = kv_cache_groups([S, S, S, S, S, F])
    assert g3.group_windows == (None,) + (W,) * 5 and g3.group_size == 1
    assert g3.layer_tensor == (0,) * 6
    # 22 local and 4 global (Gemma 3 1B): groups of 4; the last local group has 2 layers.
    big = kv_cache_groups([F if (i + 1) % 6 == 0 else S for i in range(26)])
    assert big.group_size == 4 and big.group_windows == (None,) + (W,) * 6
    assert [big.layer_group.count(g) for g in range(7)] == [4, 4, 4, 4, 4, 4, 2]
    assert big.tensors_of(range(13, 26)) == [0, 1, 2, 3]
    # A KV connector moves one block list for every layer: one group, no window.
    assert kv_cache_groups([S, F, S, F], hybrid=False).group_windows == (None,)


def test_a_configured_connector_keeps_one_group(tmp_path_factory):
    path = make_tiny_checkpoint("gemma2", tmp_path_factory.mktemp("tiny-gemma2-conn"),
                                tie_word_embeddings=False)
    plain = EngineArgs(model=path, device="cpu").create_config()
    assert plain.cache.kv_groups.group_windows == (None, W, W)
    connected = EngineArgs(model=path, device="cpu", kv_offloading_size=0.01).create_config()
    assert connected.cache.kv_groups.group_windows == (None,)
    # A block serves one layer of each group: a third of the bytes of one for every layer.
    one_layer = plain.cache.bytes_per_block(plain.model)
    assert connected.cache.bytes_per_block(connected.model) == 3 * one_layer


def test_a_windowed_group_counts_its_window_and_reach_not_the_request():
    groups = kv_cache_groups([S, F, S])
    # A step reaching 20 past the confirmed count, blocks of 8: keys from 23 before that count
    # through 20 after it touch at most cdiv(43, 8) + 1 = 7 blocks.
    assert window_blocks(W, 8, 20) == 7
    assert groups.peak_blocks(200, 8, 20) == 25 + 7 + 7
    assert groups.peak_blocks(40, 8, 20) == 3 * 5     # shorter than the caps: all of it
    assert groups.peak_blocks(200, 8, None) == 3 * 25   # no reach known: every group all of it
    assert groups.capacity_tokens(43, 8, 20) == 29 * 8   # 29 + 7 + 7 = 43
    assert groups.capacity_tokens(43, 8, None) == 14 * 8
    only_local = kv_cache_groups([S, S])
    assert only_local.capacity_tokens(7, 8, 20) is None   # any length: the window is all it holds
    assert only_local.capacity_tokens(6, 8, 20) == 6 * 8


def test_the_reach_counts_a_step_and_the_unknown_tokens_of_the_others_in_flight(tmp_path_factory):
    path = make_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("tiny-gemma3-reach"),
                                tie_word_embeddings=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert window_reach(EngineArgs(model=path, device="cpu", max_num_batched_tokens=16)
                        .create_config()) == 16
    assert window_reach(EngineArgs(model=path, device="cpu", max_num_batched_tokens=16,
                                   async_scheduling=True, speculative_config=spec)
                        .create_config()) == 16 + 1 * (1 + 3)


# -- the block manager ---------------------------------------------------------------------

def test_only_windowed_groups_give_blocks_back():
    sched = make_scheduler(num_blocks=64, budget=8, window=(None, 6, 6))
    runner = CheckedRunner(sched)
    runner.add(make_request("r", 30, max_tokens=12))
    runner.drain(1)
    runner.check_ledger()
    # The last step's query sits at 40 and reads 35..40: each windowed group gave back blocks 0-7.
    assert sched.kv_cache.num_window_freed_blocks == 2 * ((40 - 6 + 1) // BS)


def test_a_hit_is_what_every_group_has():
    kv = KVCacheManager(64, BS, group_windows=(None, 9))   # the window reads 2 blocks back
    r = make_request("r", 30)   # 7 full blocks
    full, local = kv.pool.get_new_blocks(7), kv.pool.get_new_blocks(7)
    null = kv.pool.null_block

    def cache(group: int, blocks, *indices: int) -> None:
        for i in indices:
            kv.pool.cache_block(blocks[i], group_hash(r.block_hashes[i], group))

    cache(0, full, 0, 1, 2, 3, 4)
    cache(1, local, 3, 4)
    assert kv.get_computed_blocks(r) == ([full[:5], [null] * 3 + local[3:5]], 20)
    # The local group's window at 5 blocks is gone; its longest hit within 5 is blocks 0-1,
    # which the full group has too.
    kv.pool.uncache_block(local[4])
    cache(1, local, 0, 1)
    assert kv.get_computed_blocks(r) == ([full[:2], local[:2]], 8)
    # No group hit at all: no hit.
    kv.pool.uncache_block(full[0])
    assert kv.get_computed_blocks(r) == ([[], []], 0)


def test_every_group_publishes_under_its_own_key_and_a_repeat_hits_all_of_them():
    sched = make_scheduler(num_blocks=64, budget=64, window=(None, 5))
    runner = CheckedRunner(sched)
    runner.add(make_request("a", 30, max_tokens=2))
    runner.drain(1)
    pool, hashes = sched.kv_cache.pool, runner.requests["a"].block_hashes
    assert all(pool.get_cached_block(group_hash(h, g)) is not None for h in hashes[:7] for g in (0, 1))
    b = make_request("b", 30, max_tokens=4)   # the same prompt
    runner.add(b)
    runner.schedule()
    assert b.num_cached_tokens == 28
    # The full group holds the whole hit; the windowed one only what a query at 28 reads.
    assert sched.kv_cache.num_null_blocks("b") == [0, 6]
    runner.drain(1)
    runner.check_ledger()


# As tests/test_token_ledger.py's random interleavings, with a full-attention group beside
# windowed ones: the oracle writes and reads every group's table, CheckedRunner checks each
# group's window state and the pool after every event, and check_ledger ends with no leak.
@settings(deadline=None, max_examples=60)
@given(num_blocks=st.integers(12, 30), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([8, 16, 64]), window=st.sampled_from([1, 4, 5, 9]),
       num_local=st.sampled_from([1, 2]), caching=st.booleans(),
       seed=st.integers(0, 2**32 - 1), num_events=st.integers(20, 120))
def test_groups_under_random_interleavings(num_blocks, depth, budget, window, num_local, caching,
                                           seed, num_events):
    rng = random.Random(seed)
    windows = (None,) + (window,) * num_local
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, window=windows, caching=caching,
                           reach=ledger_reach(budget, depth))
    runner = CheckedRunner(sched, random_drafts(random.Random(seed + 1)))
    # Requests as long as the full group and the windowed groups' caps let them be.
    run_random_requests(runner, rng, longest_blocks(sched), num_events, depth, max_prompt=40,
                        max_tokens=30)


# -- Gemma 2 and 3 against transformers ------------------------------------------------------

BLOCK = 8
# Blocks of 8 tokens for 120-token requests (15 blocks in each group, at most): room for one
# request whose every group holds all of it, and a little more, where the four requests need
# more than twice that at once.
NUM_KV_BLOCKS = {"gemma2": 40, "gemma3": 48}
ARCHS = {
    # Gemma 2 with local and global layers alternating: two groups of two layers.
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4),
    # Gemma 3's default tiny layout (local, global, local): three groups of one layer.
    "gemma3": {},
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hybrid(request, tmp_path_factory) -> tuple[str, str]:
    arch = request.param
    return arch, make_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}-hybrid"),
                                      tie_word_embeddings=False, **ARCHS[arch])


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernels)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_local_blocks_leave_mid_request_and_output_matches_transformers(hybrid, backend,
                                                                        async_scheduling):
    arch, path = hybrid
    max_tokens = 20
    batch = long_prompts()
    ref = Reference(path)
    want = [ref.greedy(p, max_tokens) for p in batch]
    with LLM(path, dtype="float32", attention_backend=backend, block_size=BLOCK,
             num_kv_blocks=NUM_KV_BLOCKS[arch], max_model_len=120, max_num_batched_tokens=16,
             max_num_seqs=4, async_scheduling=async_scheduling,
             # Unigram matches: these models seldom repeat a pair of tokens.
             speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 4}) as llm:
        kv = llm.engine.core.scheduler.kv_cache
        assert kv.group_windows[0] is None and set(kv.group_windows[1:]) == {W}
        runner = llm.engine.core.executor.worker.runner
        attn = [layer.self_attn.attn for layer in runner.model.model.layers]
        assert [a.kv_group for a in attn] == list(llm.engine.core.config.cache.kv_groups.layer_group)
        # Layers of different groups share a tensor; a layer never shares with its own group.
        assert len({id(t) for t in runner.kv_caches}) == llm.engine.core.config.cache.kv_groups.group_size
        run_evicting(llm, batch, want, min_freed=20)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_longer_than_every_group_could_hold_runs_within_the_windows(hybrid, async_scheduling):
    """The local groups hold their window and a step's reach, not the request: a 200-token
    prompt runs where the cache holds 112 (Gemma 3) or 168 (Gemma 2) tokens in every group,
    which is where max_model_len was capped before, token-identical to transformers, with
    drafts or async scheduling (KVCacheManager asserts the caps at every allocation)."""
    arch, path = hybrid
    rng = random.Random(5)
    loop = [rng.randrange(100, 40000) for _ in range(12)]
    prompt = ([rng.randrange(100, 40000) for _ in range(40)] + loop * 14)[:200]
    want = Reference(path).greedy(prompt, 16)
    with LLM(path, dtype="float32", block_size=BLOCK, num_kv_blocks=44, max_model_len=232,
             max_num_batched_tokens=16, async_scheduling=async_scheduling,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 4}) as llm:
        core = llm.engine.core
        cache = core.config.cache
        assert cache.capacity_tokens(44) < len(prompt) <= cache.capacity_tokens(44, window_reach(core.config))
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == want
        kv = core.scheduler.kv_cache
        assert kv.num_window_freed_blocks > 20
        assert async_scheduling or llm.get_stats().spec_decoding.num_draft_tokens > 0
        kv.assert_no_leaks()


def test_groups_hold_a_long_prompt_in_less_memory_than_one_table(hybrid):
    """The most KV bytes one long request holds at once, with groups and with one table for
    every layer (a connector's layout): the local layers keep about a window each."""
    arch, path = hybrid
    prompt = long_prompts()[3][:88]   # 88 tokens: 3.7 windows
    peak = {}
    for name, extra in (("groups", {}), ("one", {"kv_offloading_size": 0.01})):
        with LLM(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_model_len=120,
                 max_num_batched_tokens=16, **extra) as llm:
            kv, cache = llm.engine.core.scheduler.kv_cache, llm.engine.core.config.cache
            held = []
            allocate = kv.allocate_slots

            def counted(*args, **kwargs):
                new = allocate(*args, **kwargs)
                held.append(kv.pool.num_usable_blocks - kv.pool.num_free_blocks)
                return new

            kv.allocate_slots = counted
            llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            peak[name] = max(held) * cache.bytes_per_block(llm.engine.core.config.model)
    assert peak["groups"] < 0.8 * peak["one"], peak
