"""Per-request block lists on top of the block pool: prefix lookup, allocation, freeing.

The publishing invariant: a block is published to the prefix cache (given its hash) only if
every slot in it will have been written before any reader can run. Blocks are published at
allocation, for tokens that are all known, because the step that allocates them writes their
K/V before any attention reads. So when a step is taken back before it runs (a request
preempted after it was given tokens this step), what it published must be withdrawn with
`unpublish`: those slots will never be written.

Sliding windows. When every attention layer has a window of W tokens (`sliding_window`, from
CacheConfig), a query at position p reads keys p - W + 1..p only (attention/backend.py), so a
block wholly before the window of the earliest query a request can still make is never read
again. It is given back to the pool while the request runs, as vLLM's SlidingWindowManager does,
and its entry in the request's list becomes the pool's null block, so entry i is still block i
of the sequence (the null entries are always the leading ones). The earliest query a request can
still make is at its confirmed count, min(num_computed_tokens, num_tokens): positions computed
whose tokens are known. Drafts and async scheduling's optimistic advance are computed but not
known, so rejecting drafts, the one rollback short of a preemption (which frees every block),
never goes below it. Asserted at every allocation: no query of the step reads a released block.
The workers are told each step how many leading blocks a request released
(CachedRequestData.num_null_blocks) and point those entries at the null block before the step
runs: another request may be writing the blocks in that very step.

With prefix caching on, a block is published before it is given back (its tokens are all
known by then); it keeps its hash and waits in the free queue, evictable (LRU), where a prefix
lookup can still hit it. `num_window_freed_blocks` counts the blocks given back.

A hit is decided as vLLM does for sliding-window layers: a hit of h blocks needs cached only
the blocks the window of its first recomputed query (at h * block_size) reaches, the last
cdiv(W - 1, block_size) of them (at least one), or all h blocks when the hit is that short.
A block's hash names its whole token prefix, so its KV is right whatever became of the blocks
before it; the hit's blocks before those it needs come as null entries, as if given back
behind the window.

Models with any full-attention layer (Gemma 2/3, local and global layers interleaved) keep every
block: one block list serves all layers, and no block leaves a global layer's view. vLLM's hybrid
allocator gives each group of layers a table of its own; treadle does not (yet). A KV connector
saves or sends a request's whole KV, so with one the scheduler passes no window here.
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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        assert sliding_window is None or sliding_window > 0
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window   # every layer's; None: keep whole sequences
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request were given back behind the window (its
        # entries there are the null block).
        self.num_released: dict[str, int] = {}
        self.num_window_freed_blocks = 0   # blocks given back behind windows, since start-up
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
        """Longest cached prefix of `request`, in whole blocks, leaving at least one token to
        compute; with a window, its leading entries may be the null block (see the module)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        # The last token is always recomputed: its logits are what the next sample needs.
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            hits = self._longest_window_hit(request.block_hashes[:max_blocks])
            return hits, len(hits) * self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _longest_window_hit(self, block_hashes: list) -> list[KVCacheBlock]:
        """The longest hit whose first recomputed query finds its window cached: the highest run
        of `needed` cached blocks, with null entries before it; or, short of such a run, the
        cached blocks from block 0 on."""
        needed = max(1, cdiv(self.sliding_window - 1, self.block_size))
        run: list[KVCacheBlock] = []   # cached blocks, from the top of the run down
        for i in range(len(block_hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == needed:
                return [self.pool.null_block] * i + run[::-1]
        return run[::-1]

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
        With a sliding window, blocks behind the window of the step's first query are given
        back afterwards (see the module's docstring).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        num_required = cdiv(total, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # A hit under a window may start with null entries (see _longest_window_hit).
        num_null_hits = sum(1 for b in new_computed_blocks if b is self.pool.null_block)
        held_hits = new_computed_blocks[num_null_hits:]
        # Hit blocks sitting in the free queue are about to leave it, so they are not allocatable.
        num_idle_hits = sum(1 for b in held_hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_idle_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.pool.touch(held_hits)
        if new_computed_blocks:
            assert not blocks, "prefix hits come before a request holds any block"
            if self.enable_caching:   # hit blocks are published already
                self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
            if num_null_hits:
                self.num_released[request.request_id] = num_null_hits
        blocks.extend(new_computed_blocks)
        if self.sliding_window is not None:
            # The step's first query, at num_computed, reads nothing that was given back.
            first_read = max(0, num_computed - self.sliding_window + 1)
            assert self.num_released.get(request.request_id, 0) * self.block_size <= first_read, (
                f"{request.request_id}: a query at {num_computed} reads a block given back "
                f"behind the window ({self.num_released[request.request_id]} blocks)")
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        if self.enable_caching:
            # Publish blocks whose tokens are all known; their KV is written this step,
            # before any attention reads it, so a later request in the same step may share them.
            if num_external_tokens:
                self.held_from[request.request_id] = num_computed // self.block_size
            num_full = min(total, request.num_tokens) // self.block_size
            self._publish(request, min(num_full, self.held_from.get(request.request_id, num_full)))
        if self.sliding_window is not None:
            self._release_behind_window(request, min(num_computed, request.num_tokens))
        return new_blocks

    def _release_behind_window(self, request: Request, num_confirmed: int) -> None:
        """Give back the request's blocks wholly before the window of a query at
        `num_confirmed`, its confirmed count: no query it can still make is earlier."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        start = self.num_released.get(rid, 0)
        end = min(max(0, num_confirmed - self.sliding_window + 1) // self.block_size, len(blocks))
        if end <= start:
            return
        released = blocks[start:end]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        self.num_released[rid] = end
        self.num_window_freed_blocks += end - start
        # Tail first, as `free` does: a chain's head stays cached the longest.
        self.pool.free_blocks(reversed(released))
        logger.debug("%s: gave back blocks %d..%d behind the window", rid, start, end - 1)

    def num_null_blocks(self, request_id: str) -> int:
        """How many leading entries of the request's block list are the null block."""
        return self.num_released.get(request_id, 0)

    def num_published_blocks(self, request: Request) -> int:
        return self.num_cached_blocks.get(request.request_id, 0)

    def unpublish(self, request: Request, num_blocks_before: int) -> None:
        """Withdraw the hashes the request published after its first `num_blocks_before`
        blocks: the step that was to write them will not run."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        end = min(self.num_cached_blocks.get(request.request_id, 0), len(blocks))
        for block in blocks[num_blocks_before:end]:
            if block is self.pool.null_block:
                # Given back behind the window this step: wholly before the step's first
                # query, so earlier steps write it, and its hash stays true.
                continue
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
            # Blocks are published before they can be given back behind the window.
            assert blocks[i] is not self.pool.null_block, (
                f"{request.request_id}: block {i} given back unpublished")
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
        """Release a request's blocks, tail first, so shared prefixes stay cached the longest
        (the null entries of blocks given back behind the window are not blocks it holds)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.held_from.pop(request.request_id, None)
        num_released = self.num_released.pop(request.request_id, 0)
        self.pool.free_blocks(reversed(blocks[num_released:]))

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids; 0 (the null block) for those given back behind the window."""
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
        assert not self.num_released, f"released counts left: {list(self.num_released)}"
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks, (
            f"{self.pool.num_usable_blocks - self.pool.num_free_blocks} blocks leaked")
        self.pool.check_invariants()
