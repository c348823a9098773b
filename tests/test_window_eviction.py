"""KV blocks that fall out of every sliding window are given back while their request runs.

The scheduler with every layer windowed (one KV cache group with a window), driven by the ledger
test's driver: its KV oracle reads only each step's window, through the workers' view of the
block table (leading entries given back point at the null block), so a block given back while
a window still needs it, or reused by another request meanwhile, fails the read; and the null
block is never written. The property test runs random interleavings (async depths, drafts
rejected or not, preemption, resets, aborts, pauses, weight updates) with a window, checking the
pool's invariants after every event and that nothing leaks at the end. Prefix hits need only
the blocks their first query's window reads (vLLM's rule). Then a tiny windowed
Mistral, fp32 and greedy, with prompts several windows long in a pool that only eviction makes
room in: token-identical to transformers, blocks given back mid-request and handed to another
request while the first still runs, with chunked prefill, prefix hits, preemption, async
scheduling and n-gram drafts.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.family_support import PretrainedReference as Reference
from tests.kernel_support import needs_kernels
from tests.test_kv_load_recovery import FakeStore
from tests.test_scheduler import BS, groups_of, make_request, make_scheduler
from tests.test_token_ledger import (MAX_RANDOM_DRAFTS, AsyncRunner, perfect_drafts, random_drafts,
                                     run_random_requests)
from tests.tiny_models import make_tiny_checkpoint
from treadle import LLM, SamplingParams
from treadle.config import CacheConfig, SchedulerConfig, layer_windows, window_reach
from treadle.core.kv_cache_groups import kv_cache_groups, step_reach
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.scheduler import Scheduler


def check_window_state(sched: Scheduler) -> None:
    """In each KV cache group, a request's given-back blocks are its leading entries, all null,
    and lie wholly before the group's window of the earliest query it can still make (a group
    without a window gives none back); the pool's invariants hold."""
    kv = sched.kv_cache
    null = kv.pool.null_block
    for rid, groups in kv.req_to_blocks.items():
        assert len({len(blocks) for blocks in groups}) == 1, f"{rid}: tables of unequal length"
        for blocks, n, window in zip(groups, kv.num_null_blocks(rid), kv.group_windows):
            assert all(b is null for b in blocks[:n]) and all(b is not null for b in blocks[n:]), rid
            request = sched.requests.get(rid)
            if request is not None and n:
                confirmed = min(request.num_computed_tokens, request.num_tokens)
                assert window is not None and n * BS <= confirmed - window + 1, (
                    f"{rid}: {n} blocks given back, but a query at {confirmed} still reads them")
    assert null.ref_cnt == 0 and null.block_hash is None
    kv.pool.check_invariants()


def ledger_reach(budget: int, depth: int) -> int:
    """config.window_reach for the ledger's runs: `budget` tokens a step, `depth` steps in
    flight, each with a sampled token and random drafts."""
    return step_reach(budget, depth, MAX_RANDOM_DRAFTS)


def longest_blocks(sched: Scheduler) -> int:
    """The block count to size random requests by (run_random_requests): one more than the
    longest request the cache can hold, in blocks, its windowed groups at their caps."""
    longest = max(n for n in range(1, sched.max_model_len + 1) if sched.kv_cache.can_fit(n))
    return longest // BS + 1


class CheckedRunner(AsyncRunner):
    """The ledger driver, checking the window state after every schedule and return."""

    def schedule(self, poll: bool = False):
        so = super().schedule(poll)
        check_window_state(self.sched)
        return so

    def complete(self):
        outs = super().complete()
        check_window_state(self.sched)
        return outs


# -- the scheduler ---------------------------------------------------------------------------

def test_blocks_behind_the_window_are_given_back_as_the_request_runs():
    window = 6
    sched = make_scheduler(num_blocks=64, budget=8, window=window)
    runner = CheckedRunner(sched)
    r = make_request("r", 30, max_tokens=20)
    runner.add(r)
    seen = []
    while sched.has_unfinished_requests():
        so = runner.schedule()
        if "r" in sched.requests:
            confirmed = min(r.num_computed_tokens - so.num_scheduled_tokens["r"], r.num_tokens)
            assert sched.kv_cache.num_null_blocks("r") == [max(0, confirmed - window + 1) // BS]
            seen.append(sched.kv_cache.num_null_blocks("r")[0])
        runner.complete()
    runner.check_ledger()
    # The last step's query sits at 48 and reads 43..48: blocks 0-9 went, in chunks and
    # then in decodes.
    assert seen[-1] == (48 - window + 1) // BS and len(set(seen)) > 5
    assert sched.kv_cache.num_window_freed_blocks == seen[-1]


def test_given_back_blocks_go_to_another_request_while_the_first_runs():
    # 8 usable blocks of 4 tokens: "a" (40 tokens in all) never holds more than 4 at once.
    sched = make_scheduler(num_blocks=9, budget=8, window=5)
    runner = CheckedRunner(sched)
    runner.add(make_request("a", 30, max_tokens=10))
    held = set()
    for _ in range(4):
        so = runner.schedule()
        held |= {b for new in so.scheduled_new_reqs for b in new.block_ids[0]}
        held |= {b for ids in so.scheduled_cached_reqs.new_block_ids for b in ids[0]}
        runner.complete()
    released = held - set(sched.kv_cache.get_block_ids("a")[0])
    # The last chunk's first query sat at 24 and read 20..: blocks 0-4 went, 5-7 are held.
    assert [len(released)] == sched.kv_cache.num_null_blocks("a") == [5]
    assert sched.kv_cache.num_free_blocks == 8 - 3
    runner.add(make_request("b", 12, first_token=500, max_tokens=4))
    runner.schedule()
    assert set(sched.kv_cache.get_block_ids("b")[0]) & released
    assert sched.requests["a"] in sched.running
    runner.drain(1)
    runner.check_ledger()
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("drafts", ["perfect", "random"])
def test_drafts_and_async_steps_never_lose_a_block_their_window_needs(depth, drafts):
    window = 5
    sched = make_scheduler(num_blocks=12, budget=8, window=window, reach=ledger_reach(8, depth))
    propose = perfect_drafts(3) if drafts == "perfect" else random_drafts(random.Random(depth))
    runner = CheckedRunner(sched, propose)
    for i in range(3):
        runner.add(make_request(f"r{i}", 17 + 5 * i, first_token=100 * (i + 1), max_tokens=30))
    runner.drain(depth)
    runner.check_ledger()
    assert sched.kv_cache.num_window_freed_blocks > 20


def test_a_window_hit_needs_only_the_blocks_its_first_query_reads():
    kv = KVCacheManager(32, BS, group_windows=(9,))   # a query reads 8 keys back: 2 blocks
    null = kv.pool.null_block
    r = make_request("r", 30)   # 7 full blocks; a hit may cover blocks 0-6
    blocks = kv.pool.get_new_blocks(7)

    def cache(*indices: int) -> None:
        for i in indices:
            kv.pool.cache_block(blocks[i], r.block_hashes[i])

    cache(0)
    assert kv.get_computed_blocks(r) == ([[blocks[0]]], 4)   # shorter than a window: from 0 on
    cache(3, 4)
    assert kv.get_computed_blocks(r) == ([[null] * 3 + blocks[3:5]], 20)
    cache(6)   # alone at the top: its window needs block 5 too
    assert kv.get_computed_blocks(r) == ([[null] * 3 + blocks[3:5]], 20)
    cache(5)
    assert kv.get_computed_blocks(r) == ([[null] * 5 + blocks[5:7]], 28)


def test_a_prefix_hit_after_the_chain_head_was_evicted_takes_only_its_window():
    sched = make_scheduler(num_blocks=64, budget=64, window=5)
    runner = CheckedRunner(sched)
    runner.add(make_request("a", 30, max_tokens=2))
    runner.drain(1)
    # Every block of "a" was published before it was given back: all 7 full ones are cached.
    pool = sched.kv_cache.pool
    assert len(pool.hash_to_block) == 7
    head = pool.get_cached_block(runner.requests["a"].block_hashes[0])
    pool.uncache_block(head)   # evicted: no whole chain is cached any more
    b = make_request("b", 30, max_tokens=4)   # the same prompt
    runner.add(b)
    runner.schedule()
    assert b.num_cached_tokens == 28   # 7 blocks, the last token recomputed
    # A query at 28 reads 24..28: block 6 is held, blocks 0-5 are null entries.
    assert sched.kv_cache.num_null_blocks("b") == [6]
    top = pool.get_cached_block(b.block_hashes[6])
    assert sched.kv_cache.get_block_ids("b")[0][:7] == [0] * 6 + [top.block_id]
    runner.drain(1)
    runner.check_ledger()


def test_a_connector_keeps_every_block_and_the_windows_come_from_the_config():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    cache = CacheConfig(block_size=BS, kv_groups=groups_of(5))
    assert Scheduler(config, cache, 64, 256).kv_cache.group_windows == (5,)
    connected = Scheduler(config, cache, 64, 256, connector=FakeStore(False, False, None))
    assert connected.kv_cache.group_windows == (None,)

    def windows(**config) -> tuple:
        return kv_cache_groups(layer_windows(SimpleNamespace(num_hidden_layers=4, **config))).group_windows

    assert windows(sliding_window=4096) == (4096,)   # Mistral
    assert windows(sliding_window=None) == (None,)
    assert windows(sliding_window=32, use_sliding_window=False) == (None,)
    local = ["sliding_attention"] * 4
    assert windows(sliding_window=24, layer_types=local) == (24,)
    # A global layer among them: a group of its own (tests/test_kv_cache_groups.py).
    assert windows(sliding_window=24, layer_types=local[:3] + ["full_attention"]) == (None, 24, 24, 24)


def test_the_null_block_is_never_freed():
    kv = KVCacheManager(8, BS, group_windows=(5,))
    with pytest.raises(AssertionError, match="null block"):
        kv.pool.free_blocks([kv.pool.null_block])


# -- random interleavings --------------------------------------------------------------------
# As tests/test_token_ledger.py's, with every layer windowed: the oracle reads each step's
# window through the workers' tables and CheckedRunner checks the window state and the pool
# after every event; check_ledger ends with no leak.
@settings(deadline=None)
@given(num_blocks=st.integers(8, 20), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([8, 16, 64]), policy=st.sampled_from(["fcfs", "priority"]),
       window=st.sampled_from([1, 3, 4, 5, 9, 17]), caching=st.booleans(),
       seed=st.integers(0, 2**32 - 1), num_events=st.integers(20, 150))
def test_windows_under_random_interleavings(num_blocks: int, depth: int, budget: int, policy: str,
                                            window: int, caching: bool, seed: int, num_events: int):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, policy=policy, window=window,
                           caching=caching, reach=ledger_reach(budget, depth))
    runner = CheckedRunner(sched, random_drafts(random.Random(seed + 1)))
    # Longer requests than the ledger's, so that windows fill and blocks go back; as long as
    # the window's cap lets them be, so often longer than the cache.
    run_random_requests(runner, rng, longest_blocks(sched), num_events, depth, max_prompt=40,
                        max_tokens=30)


# -- a tiny windowed Mistral against transformers --------------------------------------------

WINDOW = 24
BLOCK = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return make_tiny_checkpoint("mistral", tmp_path_factory.mktemp("tiny-mistral-evict"),
                                tie_word_embeddings=False, sliding_window=WINDOW)


def long_prompts() -> list[list[int]]:
    """Four prompts of 3-4 windows; two share their first 40 tokens, and each repeats a stretch
    of itself, so that the n-gram proposer has drafts to offer."""
    rng = random.Random(11)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    out = []
    for i, n in enumerate((72, 90, 80, 95)):
        head = shared if i < 2 else [rng.randrange(100, 40000) for _ in range(40)]
        loop = [rng.randrange(100, 40000) for _ in range(12)]
        body = head + (loop * 10)
        out.append(body[:n])
    return out


class ReuseLog:
    """Watches the scheduler's KV cache manager: which blocks each request gave back behind its
    window, and which of them another request was given while the first still held blocks."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.released_by: dict[int, str] = {}
        self.reused: list[tuple[int, str, str]] = []   # (block, given back by, taken by)
        release, allocate = kv._release_behind_window, kv.allocate_slots

        def logged_release(request, group, num_confirmed):
            before = kv.get_block_ids(request.request_id)[group]
            release(request, group, num_confirmed)
            after = kv.get_block_ids(request.request_id)[group]
            for b, a in zip(before, after):
                if b != a:
                    self.released_by[b] = request.request_id

        def logged_allocate(request, *args, **kwargs):
            new = allocate(request, *args, **kwargs)
            for block in (b for group in new or () for b in group):
                owner = self.released_by.pop(block.block_id, None)
                if owner is not None and owner != request.request_id and kv.holds_blocks(owner):
                    self.reused.append((block.block_id, owner, request.request_id))
            return new

        kv._release_behind_window, kv.allocate_slots = logged_release, logged_allocate


class MaskedReads:
    """Wraps the workers' attention metadata: a table entry a step's row still shows behind its
    first query's window (which a kernel may read under a mask: the C++ prefill kernel reads
    whole 16-key tiles) is never a block that any request writes in that step. Counts the
    entries found pointing at the null block there."""

    def __init__(self, runner) -> None:
        self.num_null_entries = 0
        build, bs = runner.attention.build_metadata, runner.block_size

        def checked(query_lens, context_lens, positions, block_table):
            rows = np.repeat(np.arange(len(query_lens)), query_lens)
            written = set(block_table[rows, positions // bs].tolist())
            assert 0 not in written, "a step writes the null block"
            for r, ctx in enumerate(context_lens.tolist()):
                behind = block_table[r, :max(0, ctx - WINDOW + 1) // bs].tolist()
                assert not written & set(behind), f"row {r} still shows a block written this step"
                self.num_null_entries += behind.count(0)
            return build(query_lens, context_lens, positions, block_table)

        runner.attention.build_metadata = checked


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernels)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_windowed_mistral_gives_back_blocks_mid_request_and_matches_transformers(
        mistral, backend, async_scheduling):
    max_tokens = 24
    ref = Reference(mistral)
    batch = long_prompts()
    want = [ref.greedy(p, max_tokens) for p in batch]
    # 15 usable blocks of 8 tokens: 120 tokens, where the four requests need 433 in all.
    with LLM(mistral, dtype="float32", attention_backend=backend, block_size=BLOCK,
             num_kv_blocks=16, max_model_len=120, max_num_batched_tokens=16, max_num_seqs=4,
             async_scheduling=async_scheduling,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4}) as llm:
        sched = llm.engine.core.scheduler
        assert sched.kv_cache.group_windows == (WINDOW,)
        reads = MaskedReads(llm.engine.core.executor.worker.runner)
        run_evicting(llm, batch, want, min_freed=30)
        assert reads.num_null_entries > 0


def test_max_model_len_counts_the_window_unless_a_connector_keeps_whole_requests(mistral):
    """Without a connector a windowed model holds its window and a step's reach, whatever the
    request's length: max_model_len is not capped by the cache (15 usable blocks of 8 here).
    With one, every block stays for the connector to save, so the cache caps it as before."""
    args = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=16, max_num_batched_tokens=16)
    with LLM(mistral, **args) as llm:
        assert llm.engine.core.config.model.max_model_len == 1024   # the model's own
        assert llm.engine.core.scheduler.kv_cache.can_fit(1024)
    with LLM(mistral, kv_offloading_size=0.01, **args) as llm:
        config = llm.engine.core.config
        assert window_reach(config) is None
        assert config.model.max_model_len == 15 * BLOCK
        assert not llm.engine.core.scheduler.kv_cache.can_fit(15 * BLOCK + 1)


def run_evicting(llm: LLM, batch: list[list[int]], want: list[list[int]], min_freed: int) -> None:
    """Greedy `batch` in a pool that only giving blocks back makes room in: the output is `want`
    (transformers'), more than `min_freed` blocks went back behind windows and some went to
    another request mid-run, with preemption and drafts; then the first two again, from the
    prefix cache; nothing leaks."""
    kv = llm.engine.core.scheduler.kv_cache
    log = ReuseLog(kv)
    params = SamplingParams(temperature=0.0, max_tokens=len(want[0]), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    stats = llm.get_stats()
    assert stats.num_window_freed_blocks == kv.num_window_freed_blocks > min_freed
    assert log.reused, "no block given back behind a window went to another request"
    assert stats.num_preemptions > 0
    assert stats.spec_decoding.num_draft_tokens > 0
    hits_before = stats.prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in batch[:2]], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want[:2]
    assert llm.get_stats().prefix_cache_hits > hits_before
    kv.assert_no_leaks()


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernels)])
def test_gemma2_with_only_local_layers_gives_back_blocks_and_matches_transformers(
        tmp_path_factory, backend):
    """Gemma 2 (soft-capped scores) with every layer local: its blocks go as Mistral's do. With
    a global layer among them, the local layers' blocks go while the global one keeps its own
    (tests/test_kv_cache_groups.py)."""
    path = make_tiny_checkpoint("gemma2", tmp_path_factory.mktemp("tiny-gemma2-local"),
                                tie_word_embeddings=False,
                                layer_types=["sliding_attention"] * 3)
    batch = long_prompts()[:3]
    ref = Reference(path)
    want = [ref.greedy(p, 16) for p in batch]
    with LLM(path, dtype="float32", attention_backend=backend, block_size=BLOCK, num_kv_blocks=16,
             max_model_len=120, max_num_batched_tokens=16, max_num_seqs=3) as llm:
        kv = llm.engine.core.scheduler.kv_cache
        assert kv.group_windows == (WINDOW,)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert kv.num_window_freed_blocks > 20
        kv.assert_no_leaks()
