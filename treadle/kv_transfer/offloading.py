"""OffloadingConnector: a bounded tier of KV blocks in host memory, least recently used first out.

`{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"cpu_bytes_to_use": N}}` (vLLM's names), or the shorthand
`kv_offloading_size` (GiB). Blocks are keyed as every block store's (`block_store.py`: prefix
hash, model, dtype, layer layout, block size, weights' identity) and checksummed (CRC32).

What runs where:
- scheduler side (the engine core's thread): an `LRUBlockIndex` of the keys the tier holds,
  within `cpu_bytes_to_use // block bytes` blocks. It answers prefix lookups, decides each
  step's saves (full blocks the step computes, not already held) and evictions, and counts the
  stats. No bytes move here.
- worker side: a `HostMemoryStore` of that many blocks. At the end of a step it applies the
  step's evictions and hands its saves to a thread of its own, which copies the blocks out of
  the cache and then checksums them, so the step returns without waiting for either. The next
  step waits, before anything writes the cache, only for copies not yet done (on CPU they
  overlap the engine's work between steps; the checksums may run on), and a step that loads
  waits for every earlier save to be sealed. Loads are synchronous, at the start of their
  step: checksum, then copy into the cache.
- on CUDA the store is pinned and the copies are non-blocking on a stream of their own
  (`CopyStream`), ordered against the step's kernels by stream waits instead of host waits.
  On CPU the same code runs with plain copies.

On CPU the tier is a budget of its own next to the KV cache. A failed load (a damaged block,
or fault injection) follows `kv_load_failure_policy`; its request's saves are never made.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from treadle.core.stats import KVTierStats
from treadle.kv_transfer.block_store import (BlockStoreConnector, BlockStoreMetadata,
                                             BlockTransfer)
from treadle.kv_transfer.host_store import HostMemoryStore, LRUBlockIndex

if TYPE_CHECKING:
    from treadle.config import KVTransferConfig, TreadleConfig
    from treadle.kv_transfer.base import KVConnectorRole

logger = logging.getLogger(__name__)


@dataclass
class OffloadingMetadata(BlockStoreMetadata):
    evictions: list[str] = field(default_factory=list)   # applied before this step's saves


def check_cpu_bytes(value: object) -> int:
    """`cpu_bytes_to_use` as an int > 0, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 2**63:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use must be "
                         f"a number of bytes > 0, got {value!r}")
    return int(value)


class OffloadingConnector(BlockStoreConnector):
    required_extra_keys = ("cpu_bytes_to_use",)

    @classmethod
    def check_config(cls, transfer: KVTransferConfig) -> None:
        # Its form only: this runs again wherever a MultiConnector is built, the workers'
        # (tiers allocated by then) included. config.py measures host_bytes, once.
        check_cpu_bytes(transfer.kv_connector_extra_config["cpu_bytes_to_use"])

    @classmethod
    def host_bytes(cls, transfer: KVTransferConfig) -> int:
        return check_cpu_bytes(transfer.kv_connector_extra_config["cpu_bytes_to_use"])

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.capacity_bytes = check_cpu_bytes(self.extra["cpu_bytes_to_use"])
        self.num_slots = self.capacity_bytes // self.block_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use "
                             f"({self.capacity_bytes}) must hold at least one KV block "
                             f"({self.block_bytes} bytes for this model and block_size)")
        # Host copies are quick: loads run at the start of their step, never on a thread
        # (where a later step's save could reuse the slot they read).
        self.load_async = False
        # Scheduler side.
        self.index = LRUBlockIndex(self.num_slots)
        self._evictions: list[str] = []   # for the workers, with the next step
        # Worker side: the store is made when the cache is known.
        self.store: HostMemoryStore | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._saving: list[tuple[Future, threading.Event]] = []

    # -- scheduler side ------------------------------------------------------------------
    def _contains(self, key: str) -> bool:
        return key in self.index

    def _lookup(self, block_hashes: list, first: int, last: int, keep_head: bool) -> int:
        # The blocks the device's prefix cache serves are in use too, though never read from
        # here: touched (a chain's head last, as the most recent), so that the tier does not
        # evict a hot prefix first and lose it by the time the device's cache lets it go.
        if keep_head:
            for h in reversed(block_hashes[:first]):
                self.index.touch(self.block_key(h))
        return super()._lookup(block_hashes, first, last, keep_head)

    def _wants(self, key: str) -> bool:
        if key in self.index:
            self.index.touch(key)
            return False
        return True

    def _new_metadata(self) -> OffloadingMetadata:
        # Blocks about to be read (now or asynchronously) are the most recently used, a chain's
        # head most of all: eviction takes tails first, as a tail is of no use without its head.
        for loads in (self._loads, *self._async_loads.values()):
            for load in reversed(loads):
                self.index.touch(load.key)
        return OffloadingMetadata()

    def _finish_meta(self, meta: BlockStoreMetadata) -> None:
        assert isinstance(meta, OffloadingMetadata)
        added: set[str] = set()
        for save in meta.saves:
            if save.key in self.index:
                continue   # two requests computed the same block this step
            added.add(save.key)
            for key in self.index.add(save.key):
                if key not in added:   # else it was never stored: its save is dropped below
                    self._evictions.append(key)
                    self.stats.evictions += 1
            # A block is of use only after its prefix: the prefix is used more recently than
            # its extensions, so eviction takes tails first (as the device's block pool does).
            hashes = self._tracked[save.req_id].request.block_hashes
            for i in reversed(range(save.index)):
                self.index.touch(self.block_key(hashes[i]))
        # Each key held once the step is built is saved once: by the first request that
        # computed it.
        first = {}
        for save in meta.saves:
            if save.key in self.index:
                first.setdefault(save.key, save)
        meta.saves = list(first.values())
        meta.evictions, self._evictions = self._evictions, []

    def _forget(self, keys: list[str]) -> None:
        for key in keys:
            if self.index.discard(key):
                self._evictions.append(key)

    def _snapshot(self) -> KVTierStats:
        stats = super()._snapshot()
        stats.bytes_stored = len(self.index) * self.block_bytes
        stats.capacity_bytes = self.capacity_bytes
        return stats

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._wait_for_saves(sealed=True)   # nothing may read a cache that is going away
        super().register_kv_caches(kv_caches)
        if kv_caches and self.store is None:
            cache = kv_caches[0]
            self.store = HostMemoryStore(self.num_slots, (len(kv_caches), *cache[:, 0].shape),
                                         cache.dtype, cache.device)

    def start_load_kv(self) -> None:
        meta = self._metadata
        # This step may write any block an earlier save still copies from, and a load reads
        # what an earlier save wrote.
        self._wait_for_saves(sealed=isinstance(meta, BlockStoreMetadata) and bool(meta.loads))
        super().start_load_kv()
        if self.store is not None:
            self.store.copies.before_compute()   # the forward reads what was loaded

    def wait_for_cache_reads(self) -> None:
        self._wait_for_saves(sealed=False)
        if self.store is not None:
            self.store.copies.before_compute()   # on a GPU: later writes follow the copies

    def _read_block(self, load: BlockTransfer) -> None:
        assert self.store is not None
        self.store.get(load.key, [cache[:, load.block_id] for cache in self._kv_caches])

    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadingMetadata) or self.store is None:
            return
        store = self.store
        for key in meta.evictions:
            store.discard(key)
        saves = [s for s in meta.saves if s.req_id not in self._failed_reqs]
        if not saves:
            return
        store.copies.after_compute()   # the copies read what this step's kernels wrote
        sources = [(s.key, [cache[:, s.block_id] for cache in self._kv_caches]) for s in saves]
        copied = threading.Event()
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="treadle-kv-offload")
        self._saving.append((self._saver.submit(self._save, sources, copied), copied))

    def _save(self, sources: list[tuple[str, list[torch.Tensor]]], copied: threading.Event
              ) -> None:
        """On the saver thread: copy the blocks out, tell the next step, then seal them."""
        store = self.store
        assert store is not None
        stored: list[str] = []
        try:
            for key, layers in sources:
                if store.put(key, layers):
                    stored.append(key)
        finally:
            # Counted before the next step, which waits for `copied`, reports the count.
            self.num_saved_blocks += len(stored)
            self._count_transferred(saved=len(stored) * self._part_bytes())
            copied.set()
        if len(stored) < len(sources):
            logger.warning("the host KV tier had no room for %d blocks", len(sources) - len(stored))
        for key in stored:
            store.seal(key)

    def _wait_for_saves(self, sealed: bool) -> None:
        """Until earlier saves have copied their blocks out of the cache (and, if `sealed`,
        checksummed them); a save that failed is logged, never raised into a step."""
        pending = []
        for future, copied in self._saving:
            if sealed:
                future.exception()   # waits
            else:
                copied.wait()
            if not future.done():
                pending.append((future, copied))
            elif future.exception() is not None:
                logger.error("saving KV to the host tier failed: %s", future.exception())
        self._saving = pending
