"""Per-request block lists on top of the block pool: prefix lookup, allocation, freeing.

A request holds one block list per KV cache group (core/kv_cache_groups.py): one list for most
models, where every layer reads the same table; one per group of layers for a model that mixes
full-attention and sliding-window layers. Entry i of every list is block i of the sequence, and
all lists take their blocks from the one pool. A list, and everything said below of one, is
per group; the counts of published blocks are the request's, the same in every group.

The publishing invariant: a block is published to the prefix cache (given its hash) only if
every slot in it will have been written before any reader can run. Blocks are published at
allocation, for tokens that are all known, because the step that allocates them writes their
K/V before any attention reads. So when a step is taken back before it runs (a request
preempted after it was given tokens this step), what it published must be withdrawn with
`unpublish`: those slots will never be written. A group's blocks are published under the
block's hash salted with the group (`group_hash`): the same tokens have a block in each group.

Sliding windows. Where a group's layers have a window of W tokens, a query at position p reads
keys p - W + 1..p only (attention/backend.py), so a block wholly before the window of the
earliest query a request can still make is never read again by that group. It is given back to
the pool while the request runs, as vLLM's SlidingWindowManager does, and its entry in the
group's list becomes the pool's null block, so entry i is still block i of the sequence (the
null entries are always the leading ones). The earliest query a request can still make is at
its confirmed count, min(num_computed_tokens, num_tokens): positions computed whose tokens are
known. Drafts and async scheduling's optimistic advance are computed but not known, so
rejecting drafts, the one rollback short of a preemption (which frees every block), never goes
below it. Asserted at every allocation: no query of the step reads a released block. The
workers are told each step how many leading blocks of each group a request released
(CachedRequestData.num_null_blocks) and point those entries at the null block before the step
runs: another request may be writing the blocks in that very step. A full-attention group
never gives a block back while the request runs.

With prefix caching on, a block is published before it is given back (its tokens are all
known by then); it keeps its hash and waits in the free queue, evictable (LRU), where a prefix
lookup can still hit it. `num_window_freed_blocks` counts the blocks given back.

A hit is decided as vLLM does for sliding-window layers: in a windowed group, a hit of h blocks
needs cached only the blocks the window of its first recomputed query (at h * block_size)
reaches, the last cdiv(W - 1, block_size) of them (at least one), or all h blocks when the hit
is that short; a full-attention group needs all h. A block's hash names its whole token prefix,
so its KV is right whatever became of the blocks before it; a windowed group's blocks before
those it needs come as null entries, as if given back behind the window. With several groups,
the hit is the longest that every group has: each group's longest within the others' shortest,
until they agree.

How many blocks a windowed group holds. A step's allocation first gives back what is behind
the window of the request's confirmed count, then extends the list to the step's end. So the
group holds the blocks of the window before the confirmed count and of what the step reaches
past it (its own tokens, and those computed on tokens not yet known): with that reach bounded
(`window_reach`, config.window_reach), at most kv_cache_groups.window_blocks of them, asserted
at every allocation. `can_fit` counts a windowed group that way, so a request far longer than
the cache can start, as long as its full-attention groups fit.

A KV connector saves or sends a request's whole KV as one block list: with one configured,
there is one group, and the scheduler passes no window here.
"""

from __future__ import annotations

import logging
import sys

from treadle.core.block_pool import BlockPool, KVCacheBlock
from treadle.core.kv_cache_groups import group_caps, held_blocks
from treadle.request import BlockHash, Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The key a group's block is published under: group 0's is the block's hash itself (so a
    model with one group keys blocks as it always has); another group's has the group appended,
    one byte on the fixed-length hash, so no two groups' keys meet."""
    return block_hash if group == 0 else block_hash + bytes([group])


# A request's blocks: one list per KV cache group.
GroupBlocks = list[list[KVCacheBlock]]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,),
                 window_reach: int | None = None) -> None:
        assert group_windows and all(w is None or w > 0 for w in group_windows)
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Each group's sliding window (None: it keeps whole sequences).
        self.group_windows = tuple(group_windows)
        self.num_groups = len(group_windows)
        self.has_windows = any(w is not None for w in group_windows)
        # The most blocks a request holds in each group (None: all of its blocks; see the module).
        self.group_caps = group_caps(group_windows, block_size, window_reach)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # How many leading blocks of each request, per group, were given back behind the
        # window (its entries there are the null block).
        self.num_released: dict[str, list[int]] = {}
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

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of `request`, in whole blocks, leaving at least one token to
        compute: the hit blocks of each group, and the tokens they hold. A windowed group's
        leading entries may be the null block (see the module)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [[] for _ in self.group_windows], 0
        # The last token is always recomputed: its logits are what the next sample needs.
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        hits = [self._group_hit(g, hashes) for g in range(self.num_groups)]
        while (n := min(len(h) for h in hits)) < max(len(h) for h in hits):
            # Each group's longest within the shortest: a full-attention hit only shortens,
            # a windowed one may find its window elsewhere, or not at all.
            hits = [h if len(h) == n else self._group_hit(g, hashes[:n]) for g, h in enumerate(hits)]
        return hits, n * self.block_size

    def _group_hit(self, group: int, block_hashes: list) -> list[KVCacheBlock]:
        """Group `group`'s longest hit within `block_hashes`."""
        if self.group_windows[group] is not None:
            return self._longest_window_hit(group, block_hashes)
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(group_hash(block_hash, group))
            if block is None:
                break
            hits.append(block)
        return hits

    def _longest_window_hit(self, group: int, block_hashes: list) -> list[KVCacheBlock]:
        """The longest hit whose first recomputed query finds its window cached: the highest run
        of `needed` cached blocks, with null entries before it; or, short of such a run, the
        cached blocks from block 0 on."""
        needed = max(1, cdiv(self.group_windows[group] - 1, self.block_size))
        run: list[KVCacheBlock] = []   # cached blocks, from the top of the run down
        for i in range(len(block_hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(group_hash(block_hashes[i], group))
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

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of this many tokens holds at once, over its groups."""
        return held_blocks(cdiv(num_tokens, self.block_size), self.group_caps)

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever be held, with every other block free?"""
        return self.peak_blocks(num_tokens) <= self.pool.num_usable_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> GroupBlocks | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        The first `num_external_tokens` of them are loaded by a KV connector: from their first
        block on, nothing of the request is published until the load is known to have
        succeeded (`settle_loaded`), since everything it computes on top depends on it.
        Returns the newly allocated blocks of each group, or None (with nothing allocated) when
        the pool is short. With a sliding window, blocks behind the window of the step's first
        query are given back first, and again after a prefix hit (see the module's docstring).
        """
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if (held is not None and new_computed_blocks is None and not num_external_tokens
                and not self.has_windows):
            total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            if all(len(blocks) * self.block_size >= total for blocks in held):
                # Most decode steps: the blocks held have room already. What the full path
                # below does then, without its lists: no block to take, only blocks to publish.
                if self.enable_caching:
                    self._publish_known(request, total)
                return [[] for _ in held]
        hits = new_computed_blocks or [[] for _ in self.group_windows]
        assert len(hits) == self.num_groups
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if self.has_windows and rid in self.req_to_blocks:   # room the window no longer needs first
            if self.enable_caching:   # blocks are published before they can be given back
                self._publish_known(request, num_computed)
            self._release_behind_windows(request, num_computed)
        groups = self.req_to_blocks.setdefault(rid, [[] for _ in self.group_windows])
        total = num_computed + num_new_tokens
        num_required = cdiv(total, self.block_size)
        num_new = [max(0, num_required - len(blocks) - len(hit)) for blocks, hit in zip(groups, hits)]
        # A hit under a window may start with null entries (see _longest_window_hit).
        num_null_hits = [sum(1 for b in hit if b is self.pool.null_block) for hit in hits]
        held_hits = [b for hit, nulls in zip(hits, num_null_hits) for b in hit[nulls:]]
        # Hit blocks sitting in the free queue are about to leave it, so they are not allocatable.
        num_idle_hits = sum(1 for b in held_hits if b.ref_cnt == 0)
        if sum(num_new) > self.pool.num_free_blocks - num_idle_hits:
            if not groups[0]:
                del self.req_to_blocks[rid]
            return None

        self.pool.touch(held_hits)
        if hits[0]:
            assert not groups[0], "prefix hits come before a request holds any block"
            if self.enable_caching:   # hit blocks are published already
                self.num_cached_blocks[rid] = len(hits[0])
            if any(num_null_hits):
                self.num_released[rid] = num_null_hits
        new_blocks = []
        for g, (blocks, hit, window) in enumerate(zip(groups, hits, self.group_windows)):
            blocks.extend(hit)
            if window is not None:
                # The step's first query, at num_computed, reads nothing that was given back.
                first_read = max(0, num_computed - window + 1)
                released = self.num_released.get(rid, [0] * self.num_groups)[g]
                assert released * self.block_size <= first_read, (
                    f"{rid}: a query at {num_computed} reads a block of group {g} given back "
                    f"behind the window ({released} blocks)")
            new_blocks.append(self.pool.get_new_blocks(num_new[g]))
            blocks.extend(new_blocks[-1])

        if self.enable_caching:
            # Publish blocks whose tokens are all known; their KV is written this step,
            # before any attention reads it, so a later request in the same step may share them.
            if num_external_tokens:
                self.held_from[rid] = num_computed // self.block_size
            self._publish_known(request, total)
        if self.has_windows:
            self._release_behind_windows(request, num_computed)
            for blocks, cap, released in zip(groups, self.group_caps, self.num_null_blocks(rid)):
                assert cap is None or len(blocks) - released <= cap, (
                    f"{rid} holds {len(blocks) - released} blocks of a windowed group, past its {cap}")
        return new_blocks

    def _release_behind_windows(self, request: Request, num_computed: int) -> None:
        """Give back, in every windowed group, what no query from the confirmed count on reads."""
        for g, window in enumerate(self.group_windows):
            if window is not None:
                self._release_behind_window(request, g, min(num_computed, request.num_tokens))

    def _release_behind_window(self, request: Request, group: int, num_confirmed: int) -> None:
        """Give back the request's blocks of `group` wholly before the window of a query at
        `num_confirmed`, its confirmed count: no query it can still make is earlier."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid][group]
        released = self.num_released.setdefault(rid, [0] * self.num_groups)
        start = released[group]
        window = self.group_windows[group]
        end = min(max(0, num_confirmed - window + 1) // self.block_size, len(blocks))
        if end <= start:
            return
        given_back = blocks[start:end]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        released[group] = end
        self.num_window_freed_blocks += end - start
        # Tail first, as `free` does: a chain's head stays cached the longest.
        self.pool.free_blocks(reversed(given_back))
        logger.debug("%s: gave back blocks %d..%d of group %d behind the window",
                     rid, start, end - 1, group)

    def num_null_blocks(self, request_id: str) -> list[int]:
        """How many leading entries of each group's block list are the null block."""
        return list(self.num_released.get(request_id, [0] * self.num_groups))

    def num_published_blocks(self, request: Request) -> int:
        return self.num_cached_blocks.get(request.request_id, 0)

    def unpublish(self, request: Request, num_blocks_before: int) -> None:
        """Withdraw the hashes the request published after its first `num_blocks_before`
        blocks: the step that was to write them will not run."""
        groups = self.req_to_blocks.get(request.request_id, [[] for _ in self.group_windows])
        for blocks in groups:
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

    def _publish_known(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks wholly within the request's first `num_tokens` tokens whose
        tokens are all known, short of where a connector's load holds them back."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self._publish(request, min(num_full, self.held_from.get(request.request_id, num_full)))

    def _publish(self, request: Request, num_blocks: int) -> None:
        """Publish the request's first `num_blocks` blocks (those not published yet)."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_blocks <= start:   # most decode steps: no block filled up
            return
        for g, blocks in enumerate(self.req_to_blocks[request.request_id]):
            for i in range(start, num_blocks):
                # Blocks are published before they can be given back behind the window.
                assert blocks[i] is not self.pool.null_block, (
                    f"{request.request_id}: block {i} of group {g} given back unpublished")
                self.pool.cache_block(blocks[i], group_hash(request.block_hashes[i], g))
        self.num_cached_blocks[request.request_id] = num_blocks

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
        groups = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.held_from.pop(request.request_id, None)
        released = self.num_released.pop(request.request_id, [0] * self.num_groups)
        for blocks, num_released in zip(groups, released):
            self.pool.free_blocks(reversed(blocks[num_released:]))

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids, per group; 0 (the null block) for those given back behind
        the window."""
        groups = self.req_to_blocks.get(request_id) or [[] for _ in self.group_windows]
        return [[b.block_id for b in blocks] for blocks in groups]

    def get_connector_block_ids(self, request_id: str) -> list[int]:
        """The request's one block list, as a KV connector takes it (with a connector there is
        one group: core/kv_cache_groups.py)."""
        assert self.num_groups == 1, "KV connectors run with one KV cache group"
        return self.get_block_ids(request_id)[0]

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
