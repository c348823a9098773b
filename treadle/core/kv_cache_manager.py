"""Per-request block lists on top of the block pool: prefix lookup, allocation, freeing.

The publishing invariant: a block is published to the prefix cache (given its hash) only if
every slot in it will have been written before any reader can run. Blocks are published at
allocation, for tokens that are all known, because the step that allocates them writes their
K/V before any attention reads. So when a step is taken back before it runs (a request
preempted after it was given tokens this step), what it published must be withdrawn with
`unpublish`: those slots will never be written.
"""

from __future__ import annotations

import logging
import sys

from treadle.core.block_pool import BlockPool, KVCacheBlock
from treadle.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Requests with a KV load not yet settled: the block index from which nothing of
        # theirs is published until it is (see allocate_slots).
        self.held_from: dict[str, int] = {}
        self.prefix_queries = 0   # tokens looked up
        self.prefix_hits = 0      # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request`, in whole blocks, leaving at least one token to compute."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        # The last token is always recomputed: its logits are what the next sample needs.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        if self.enable_caching:
            self.prefix_queries += num_queried
            self.prefix_hits += num_hit

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever be held, with every other block free?"""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_usable_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        The first `num_external_tokens` of them are loaded by a KV connector: from their first
        block on, nothing of the request is published until the load is known to have
        succeeded (`settle_loaded`), since everything it computes on top depends on it.
        Returns the newly allocated blocks, or None (with nothing changed) when the pool is short.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        num_required = cdiv(total, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hit blocks sitting in the free queue are about to leave it, so they are not allocatable.
        num_idle_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_idle_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        if self.enable_caching:
            # Publish blocks whose tokens are all known; their KV is written this step,
            # before any attention reads it, so a later request in the same step may share them.
            if num_external_tokens:
                self.held_from[request.request_id] = num_computed // self.block_size
            num_full = min(total, request.num_tokens) // self.block_size
            self._publish(request, min(num_full, self.held_from.get(request.request_id, num_full)))
        return new_blocks

    def num_published_blocks(self, request: Request) -> int:
        return self.num_cached_blocks.get(request.request_id, 0)

    def unpublish(self, request: Request, num_blocks_before: int) -> None:
        """Withdraw the hashes the request published after its first `num_blocks_before`
        blocks: the step that was to write them will not run."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        end = min(self.num_cached_blocks.get(request.request_id, 0), len(blocks))
        for block in blocks[num_blocks_before:end]:
            # Published this step, before any other request could look it up.
            assert block.ref_cnt == 1, f"{block} was shared before its KV was written"
            self.pool.uncache_block(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(
                num_blocks_before, self.num_cached_blocks[request.request_id])

    def _publish(self, request: Request, num_blocks: int) -> None:
        """Publish the request's first `num_blocks` blocks (those not published yet)."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_blocks):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, num_blocks)

    def settle_loaded(self, request: Request, first_bad_block: int | None) -> None:
        """A connector's load for the request has returned: publish what it held back, up to
        the first block that failed to load (everything, when none did)."""
        if self.held_from.pop(request.request_id, None) is None or not self.enable_caching:
            return
        computed = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        self._publish(request, computed if first_bad_block is None else first_bad_block)

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so shared prefixes stay cached the longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.held_from.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget cached prefixes; False while blocks are held, unless forced (after a weight
        update): then requests holding blocks now never publish another block, since all their
        KV, later blocks included, depends on KV computed with the old weights."""
        ok = self.pool.reset_prefix_cache(force)
        if force:
            for request_id in self.req_to_blocks:
                self.num_cached_blocks[request_id] = sys.maxsize
        if ok:
            logger.info("prefix cache reset")
        return ok

    def assert_no_leaks(self) -> None:
        """Every block is free and no request holds any: the state after all requests end."""
        assert not self.req_to_blocks, f"requests still hold blocks: {list(self.req_to_blocks)}"
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks, (
            f"{self.pool.num_usable_blocks - self.pool.num_free_blocks} blocks leaked")
        self.pool.check_invariants()
