"""Block pool and KV cache manager invariants."""

from __future__ import annotations

import pytest

from treadle.core.block_pool import BlockPool
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.request import Request, hash_block
from treadle.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), eos_token_id=None,
                   cache_salt=salt, block_size=BS)


def test_free_queue_is_lru_and_null_block_is_reserved():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    for i, b in enumerate(a):
        pool.cache_block(b, bytes([i]))
    pool.free_blocks(reversed(a))               # tail first: 3, 2, 1
    assert [b.block_id for b in pool.free_queue] == [4, 5, 3, 2, 1]
    assert pool.null_block.block_id == 0 and pool.null_block not in list(pool.free_queue)
    pool.check_invariants()


def test_blocks_that_cache_nothing_are_handed_out_first():
    """Before any cached block (its prefix kept longer), and most recently freed first: memory
    already touched, where a never-used block page-faults on its first write."""
    pool = BlockPool(8)
    a = pool.get_new_blocks(4)
    pool.cache_block(a[0], b"\x00")
    pool.cache_block(a[1], b"\x01")
    pool.free_blocks(reversed(a))   # 4 and 3 cache nothing; 2 and 1 do
    assert [b.block_id for b in pool.free_queue] == [3, 4, 5, 6, 7, 2, 1]
    again = pool.get_new_blocks(3)
    assert [b.block_id for b in again] == [3, 4, 5]
    assert pool.get_cached_block(b"\x00") is a[0] and pool.get_cached_block(b"\x01") is a[1]
    pool.check_invariants()


def test_reused_block_loses_its_hash_lazily():
    pool = BlockPool(3)
    [b] = pool.get_new_blocks(1)
    pool.cache_block(b, b"h1")
    pool.free_blocks([b])
    assert pool.get_cached_block(b"h1") is b      # freed but still cached (lazy eviction)
    got = pool.get_new_blocks(2)                  # the second allocation reaches b
    assert b in got and b.block_hash is None and pool.get_cached_block(b"h1") is None
    pool.check_invariants()


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    r1 = req("a", list(range(8)))
    assert kv.allocate_slots(r1, 8) is not None       # 2 blocks
    before = [(b.block_id, b.ref_cnt) for b in kv.pool.blocks]
    r2 = req("b", list(range(100, 108)))
    assert kv.allocate_slots(r2, 8) is None           # needs 2, only 1 free
    assert [(b.block_id, b.ref_cnt) for b in kv.pool.blocks] == before
    assert "b" not in kv.req_to_blocks
    kv.free(r1)
    kv.assert_no_leaks()


def test_prefix_hit_never_evicts_the_blocks_it_hit():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    r1 = req("a", list(range(9)))                     # 2 full blocks + 1 token
    kv.allocate_slots(r1, 9)
    kv.free(r1)                                       # all 3 free, the 2 full ones cached
    r2 = req("b", list(range(8)) + [99, 98, 97, 96, 95])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and len(hits) == 1 and len(hits[0]) == 2   # one KV cache group
    # 13 tokens need 4 blocks; 2 are hits, 2 new ones but only 1 block is not a hit: refuse.
    assert kv.allocate_slots(r2, 5, hits, n) is None
    assert all(kv.pool.get_cached_block(b.block_hash) is b for b in hits[0])
    r3 = req("c", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(r3)
    assert kv.allocate_slots(r3, 2, hits, n) is not None
    assert kv.get_block_ids("c")[0][:2] == [b.block_id for b in hits[0]]
    kv.free(r3)
    kv.assert_no_leaks()


def test_hit_is_capped_to_leave_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r1 = req("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    kv.free(r1)
    _, n = kv.get_computed_blocks(req("b", list(range(8))))
    assert n == 4          # the whole prompt is cached, but its last block is recomputed


def test_hash_chains_parent_tokens_and_salt():
    h1 = hash_block(None, (1, 2, 3, 4), ())
    assert hash_block(h1, (5, 6, 7, 8), ()) != hash_block(hash_block(None, (0, 2, 3, 4), ()), (5, 6, 7, 8), ())
    assert req("a", list(range(8)), salt="x").block_hashes[0] != req("b", list(range(8))).block_hashes[0]
    # A salt changes every later block too, through the chain.
    assert req("a", list(range(8)), salt="x").block_hashes[1] != req("b", list(range(8))).block_hashes[1]


def test_reset_prefix_cache_refused_while_in_use_then_clears_every_hash():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r1 = req("a", list(range(12)))
    kv.allocate_slots(r1, 12)
    assert kv.reset_prefix_cache() is False
    assert kv.pool.hash_to_block
    kv.free(r1)
    assert kv.reset_prefix_cache() is True
    assert not kv.pool.hash_to_block
    assert all(b.block_hash is None for b in kv.pool.blocks)
    kv.assert_no_leaks()


def test_shared_prefix_blocks_are_refcounted():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r1, r2 = req("a", list(range(10))), req("b", list(range(10)))
    kv.allocate_slots(r1, 10)
    hits, n = kv.get_computed_blocks(r2)
    kv.allocate_slots(r2, 10 - n, hits, n)
    shared = kv.req_to_blocks["a"][0][:2]
    assert kv.req_to_blocks["b"][0][:2] == shared and all(b.ref_cnt == 2 for b in shared)
    kv.free(r1)
    assert all(b.ref_cnt == 1 for b in shared)
    kv.free(r2)
    kv.assert_no_leaks()


def test_freeing_tail_first_keeps_shared_prefix_longest():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    r1 = req("a", list(range(12)))
    kv.allocate_slots(r1, 12)
    ids = kv.get_block_ids("a")[0]
    kv.free(r1)
    # The tail block sits nearest the head of the free queue, so it is evicted first.
    order = [b.block_id for b in kv.pool.free_queue]
    assert order.index(ids[2]) < order.index(ids[1]) < order.index(ids[0])


@pytest.mark.parametrize("num", [0, 1, 5])
def test_allocation_within_capacity(num):
    pool = BlockPool(6)
    assert len(pool.get_new_blocks(num)) == num
    with pytest.raises(ValueError):
        pool.get_new_blocks(6 - num)


def test_usage_counts_cached_but_free_blocks_as_free():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    r1 = req("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    assert kv.pool.usage() == 0.5
    kv.free(r1)
    assert kv.pool.hash_to_block and kv.pool.usage() == 0.0


def test_no_salt_spells_another_first_block_key():
    """A salt of "long_rope" on a request with short RoPE factors once made the same first-
    block key as a request with LongRoPE's long factors and no salt: it read that KV (other
    factors: wrong tokens), and salts no longer kept tenants apart."""
    tokens = list(range(100, 100 + 2 * BS))
    salted, long = req("a", tokens, salt="long_rope"), req("b", tokens)
    long.use_long_rope()
    assert salted.block_hashes[0] != long.block_hashes[0]
    again = req("c", tokens, salt="long_rope")
    assert again.block_hashes == salted.block_hashes   # a salt still hits its own blocks
