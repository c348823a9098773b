"""Physical KV blocks: reference counts, a free queue and the prefix-hash index.

The free queue hands out first the freed blocks that cache nothing, most recently freed
first, then the cached ones, least recently freed first (LRU). A block with no hash has no
prefix to keep, so taking it before any cached one keeps prefixes longer; and a block just
freed is memory already touched, often still in cache, where an untouched one costs a page
fault per page on its first write (about 1 GB/s on these VMs: 13 ms of a 288-token fp32
prompt; docs/performance-log.md).

Invariants (checked by `check_invariants`, used by tests):
  - a block is in the free queue iff its ref_cnt is 0 (the null block is never in it, never
    handed out and never freed; a request's block list holds it in place of blocks it gave
    back behind a sliding window: core/kv_cache_manager.py);
  - a block has a hash iff the index maps that hash to it;
  - eviction is lazy: a freed block keeps its hash until it is handed out again.
"""

from __future__ import annotations

from typing import Iterable

from treadle.request import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is handed out first.

    A linked list (not a deque) so that a prefix hit can pull a block out of the middle in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None and prev.next_free is not None
        nxt = prev.next_free
        prev.next_free, block.prev_free = block, prev
        block.next_free, nxt.prev_free = nxt, block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail and b is not None:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 2, "need the null block and at least one real block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Block 0 is the null block: padding in block tables, never allocated, never freed.
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks held by requests; free blocks that still cache a prefix count as free."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.hash_to_block.get(block_hash)

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        if num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the given order:
        cached ones at its tail (evicted last), the others at its head (handed out next)."""
        for block in ordered_blocks:
            assert block is not self.null_block, "the null block is never freed"
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash; the first block to claim a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.hash_to_block:
            return
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Withdraw a block's hash, if the index maps it to this block."""
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) is block:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cached prefix. Refused (False) while any block is held by a request,
        unless forced: then held blocks stop being shareable too (their KV is stale after a
        weight update) while their holders keep using them."""
        if not force and self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.hash_to_block.values():
            block.block_hash = None
        self.hash_to_block.clear()
        return True

    def check_invariants(self) -> None:
        free_ids = {b.block_id for b in self.free_queue}
        assert len(free_ids) == self.num_free_blocks
        assert 0 not in free_ids, "null block in the free queue"
        for b in self.blocks[1:]:
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"{b} ref/free mismatch"
            if b.block_hash is not None:
                assert self.hash_to_block.get(b.block_hash) is b, f"{b} hash not indexed"
        for h, b in self.hash_to_block.items():
            assert b.block_hash == h
