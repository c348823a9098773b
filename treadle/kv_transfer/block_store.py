"""What every connector that keeps full KV blocks under keys shares: the scheduler side's
tracking of requests (what to load, what to save, per tenancy), its counters, and the worker
side's loads with fault injection. Subclasses say where blocks live: files
(`shared_storage.py`), host memory (`offloading.py`).

A block's key is its prefix hash and what makes KV differ between engines: the model, the
dtype, the layer layout, the block size and the weights' identity (see `engine/weights.py`;
never the user's weight_version label). A producer saves the blocks each step computes; a
consumer, when it first schedules a request, loads the longest run of stored blocks after its
local prefix-cache hit.

With pipeline or tensor parallelism each worker rank saves and loads its own part of a block
(its stage's layers, its KV heads) under the block's key and the part's name (`rank_part`), so
parts never mix. The scheduler side counts a block stored only when every rank's part is; a
part that fails to load on any rank is a load error of the block (the executor unites the
ranks' reports: `aggregate.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from treadle.core.stats import KVTierStats
from treadle.distributed.parallel_state import ParallelContext
from treadle.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                      KVConnectorRole, LoadFaultInjector)

if TYPE_CHECKING:
    from treadle.config import TreadleConfig
    from treadle.core.scheduler_output import SchedulerOutput
    from treadle.request import Request

logger = logging.getLogger(__name__)


def rank_part(config: TreadleConfig, pp_rank: int, tp_rank: int) -> str:
    """What a rank's part of a block is named in keys: its layers and its share of the KV
    heads; "" with one worker (a whole block)."""
    pp, tp = config.parallel.pipeline_parallel_size, config.parallel.tensor_parallel_size
    if pp * tp == 1:
        return ""
    layers = ParallelContext(pp_rank=pp_rank, pp_size=pp).layer_range(config.model.num_layers)
    return f".L{layers.start}-{layers.stop}.tp{tp_rank}of{tp}"


@dataclass
class BlockTransfer:
    req_id: str
    block_id: int      # where the block sits in the paged cache
    key: str           # its name in the store
    index: int         # its position in its request (what fault injection counts)


@dataclass
class BlockStoreMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    async_loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)   # per request
    saves: list[BlockTransfer] = field(default_factory=list)
    # How long the worker may wait for an asynchronous load to finish: a step with no tokens
    # exists only to hear about them, so it waits a little rather than spin.
    poll_wait_s: float = 0.0


@dataclass
class _Tracked:
    """One tenancy of a request: from its admission (update_state_after_alloc) until it ends
    or is admitted again after a preemption."""

    request: Request
    block_ids: list[int]
    num_handled: int   # leading blocks already in the store (saved, loaded or hit locally)
    weights_identity: str   # of the weights its KV was computed with from the start
    loaded: dict[int, str] = field(default_factory=dict)   # block id -> key it loads from here
    saved: list[str] = field(default_factory=list)   # keys it asked the workers to save


def checkpoint_digest(path: str) -> str:
    """A digest of what a checkpoint computes with: its config and weight files' contents."""
    root = Path(path)
    files = ([root] if root.is_file() else
             sorted(p for p in root.iterdir() if p.is_file() and (
                 p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\n".encode())
        with open(f, "rb") as fh:
            digest.update(hashlib.file_digest(fh, "sha256").digest())
    return digest.hexdigest()


class BlockStoreConnector(KVConnectorBase):
    """A connector over a store of full blocks by key; subclasses implement the store."""

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.block_size = config.cache.block_size
        model = config.model
        # Weight-only quantization changes the KV too.
        self._layout = (os.path.realpath(model.model), str(model.dtype), model.quantization,
                        model.num_layers, model.num_kv_heads, model.head_dim, self.block_size)
        elem = torch.tensor([], dtype=model.dtype).element_size()
        self.block_bytes = (2 * model.num_layers * self.block_size * model.num_kv_heads
                            * model.head_dim * elem)
        parallel = config.parallel
        # Scheduler side: every rank's part of a block; worker side: this rank's (bind_rank).
        self.parts = [rank_part(config, pp, tp) for pp in range(parallel.pipeline_parallel_size)
                      for tp in range(parallel.tensor_parallel_size)]
        self.part = self.parts[0]
        # Of the weights served: the engine's checkpoint until weights_changed() (the name
        # ServedWeights gives it).
        self.weights_identity = "checkpoint"
        # With "load_async": true, loads run on a worker thread while the engine steps on, and
        # their requests wait (WAITING_FOR_REMOTE_KVS) until they are done.
        self.load_async = bool(self.extra.get("load_async", False))
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        # A waiting request's head (the blocks its local hit serves) already kept in use by a
        # lookup (`_lookup`'s keep_head): that hit, in blocks. The lookup repeats every step
        # while a request waits for room; its head is kept again only if the hit grew.
        # Dropped on admission and on finishing.
        self._head_kept: dict[str, int] = {}
        self._loads: list[BlockTransfer] = []
        self._async_loads: dict[str, list[BlockTransfer]] = {}
        self.stats = KVTierStats(connector=self.name)
        # Worker side.
        self._kv_caches: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        # Requests with a failed load: what they compute on top of it is wrong, so none of it
        # is saved until the scheduler has reset them (they arrive in finished_req_ids).
        self._failed_reqs: set[str] = set()
        self._io: ThreadPoolExecutor | None = None
        self._recving: dict[str, Future] = {}   # request -> its asynchronous load
        self.load_delay_s = float(self.extra.get("inject_load_delay_s", 0.0))
        self.injector = LoadFaultInjector(self.extra)
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_failed_loads = 0
        self._dropped = 0   # block saves dropped since last reported
        self._transferred = (0, 0)   # bytes saved and loaded since last reported
        self._tally_lock = threading.Lock()   # saver and loader threads add, the step takes

    def _name_model_by_contents(self) -> None:
        """For a store other instances share: blocks name the model by what it computes with
        (its config's and weight files' contents), not by where it lies, so that other weights
        at the same path (a folder redeployed) never read KV of these (invariant 5). Only the
        scheduler side names blocks; hashing the files takes a while for a large model."""
        if self.role != KVConnectorRole.SCHEDULER:
            return
        start = time.perf_counter()
        self._layout = (checkpoint_digest(self.config.model.model), *self._layout[1:])
        logger.info("%s: checkpoint digest %s in %.1f s", type(self).__name__,
                    self._layout[0][:12], time.perf_counter() - start)

    # -- what subclasses implement ----------------------------------------------------------

    def _contains(self, key: str) -> bool:
        """Scheduler side: whether the store holds `key` (a load may still fail)."""
        raise NotImplementedError

    def _num_stored(self, keys: list[str]) -> int:
        """Scheduler side: how many of `keys`, from the first, the store holds."""
        return next((i for i, key in enumerate(keys) if not self._contains(key)), len(keys))

    def _read_block(self, load: BlockTransfer) -> None:
        """Worker side: the block into the cache, checksum verified; raises if it cannot."""
        raise NotImplementedError

    def _forget(self, keys: list[str]) -> None:
        """Scheduler side: these keys failed to load, or were never saved (their request's
        load failed)."""

    # -- naming --------------------------------------------------------------------------
    def block_key(self, block_hash: bytes) -> str:
        identity = repr((self._layout, self.weights_identity)).encode()
        return hashlib.sha256(identity + block_hash).hexdigest()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.is_consumer:
            return 0, False
        # Whole blocks after the local hit, leaving the last token to compute (its logits).
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        keep_head = first > self._head_kept.get(request.request_id, 0)
        if keep_head:
            self._head_kept[request.request_id] = first
        num_blocks = self._lookup(request.block_hashes, first, last, keep_head)
        return num_blocks * self.block_size, self.load_async and num_blocks > 0

    def _lookup(self, block_hashes: list, first: int, last: int, keep_head: bool) -> int:
        """How many of blocks first..last-1 the store holds, from the first; the prefix cache
        here served the blocks before `first` (the head). With `keep_head`, a store that ages
        blocks also counts the head as used (subclasses)."""
        return self._num_stored([self.block_key(h) for h in block_hashes[first:last]])

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._head_kept.pop(request.request_id, None)
        first = request.num_computed_tokens // self.block_size
        num_external = num_external_tokens // self.block_size
        loads = [BlockTransfer(request.request_id, block_ids[i],
                               self.block_key(request.block_hashes[i]), i)
                 for i in range(first, first + num_external)]
        if self.is_consumer and not (request.kv_load_failed or request.skip_reading_prefix_cache):
            # Looked up past the local hit (admission's rule): served here, or not.
            eligible = max(0, (request.num_tokens - 1) // self.block_size - first)
            self.stats.hits += num_external
            self.stats.misses += eligible - num_external
        if self.load_async and loads:
            self._async_loads[request.request_id] = loads
        else:
            self._loads += loads
        # A new tenancy starts: whatever was tracked for the id before (a preempted request,
        # reset or cut back by a failed load) is replaced.
        self._tracked[request.request_id] = _Tracked(request, list(block_ids), first + num_external,
                                                     self.weights_identity,
                                                     {load.block_id: load.key for load in loads})

    def weights_changed(self, weights_identity: str) -> None:
        self.weights_identity = weights_identity

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockStoreMetadata:
        meta = self._new_metadata()
        meta.loads, meta.async_loads = self._loads, self._async_loads
        meta.poll_wait_s = 0.0 if scheduler_output.num_scheduled_tokens else 0.005
        self._loads, self._async_loads = [], {}
        # Tracking is not dropped by finished_req_ids: a request preempted there may have been
        # admitted again since, even in this very schedule (an asynchronous load puts it in
        # no step's new requests). It ends in request_finished or update_state_after_alloc.
        # With a connector there is one KV cache group (core/kv_cache_groups.py): group 0's.
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            self._tracked[rid].block_ids += block_ids[0]
        for new in scheduler_output.scheduled_new_reqs:   # maybe back from an asynchronous load
            tracked = self._tracked[new.req_id]
            tracked.block_ids = list(new.block_ids[0])
            tracked.num_handled = min(tracked.num_handled, new.num_computed_tokens // self.block_size)
        if not self.is_producer:
            return meta
        for rid in scheduler_output.num_scheduled_tokens:
            tracked = self._tracked[rid]
            if tracked.weights_identity != self.weights_identity:
                continue   # computed on KV of older weights: right under no identity's key
            request = tracked.request
            # Blocks whose tokens are all known and computed once this step has run.
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            for i in range(tracked.num_handled, num_full):
                save = BlockTransfer(rid, tracked.block_ids[i],
                                     self.block_key(request.block_hashes[i]), i)
                if self._wants(save.key):
                    meta.saves.append(save)
            tracked.num_handled = max(tracked.num_handled, num_full)
        self._finish_meta(meta)
        for save in meta.saves:
            self._tracked[save.req_id].saved.append(save.key)
        return meta

    def _new_metadata(self) -> BlockStoreMetadata:
        return BlockStoreMetadata()

    def _wants(self, key: str) -> bool:
        """Whether a block computed here is to be saved under `key`."""
        return True

    def _finish_meta(self, meta: BlockStoreMetadata) -> None:
        """The step's saves are chosen: a store may change them (and add its own orders)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A failed load, from this store or another (MultiConnector): the keys that failed are
        forgotten, and so is what the request asked to save, as it saved nothing since it was
        admitted (the workers held its saves back). A block that failed to load is its
        loader's alone until then, so it names that request."""
        # Counted as the workers report what completed, so that each only grows (a
        # Prometheus counter): a load in flight, or one that failed, has moved nothing yet.
        saved, loaded = output.transferred.get(self.name, (0, 0))
        self.stats.bytes_saved += saved
        self.stats.bytes_loaded += loaded
        self.stats.dropped_saves += output.dropped_saves.get(self.name, 0)
        invalid = output.invalid_block_ids
        if not invalid:
            return
        for tracked in self._tracked.values():
            bad = [tracked.loaded.pop(b) for b in invalid & tracked.loaded.keys()]
            self.stats.failed_loads += len(bad)
            self._forget(bad)
            if tracked.saved and not invalid.isdisjoint(tracked.block_ids):
                self._forget(tracked.saved)
                tracked.saved = []

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish within their step (or on the workers' own time): nothing to wait for."""
        self._head_kept.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if not self.is_producer or tracked is None:
            return False, None
        return False, self._transfer_params(tracked)

    def _transfer_params(self, tracked: _Tracked) -> dict[str, Any] | None:
        return None

    def get_stats(self) -> list[KVTierStats]:
        return [self._snapshot()]

    def _snapshot(self) -> KVTierStats:
        return dataclasses.replace(self.stats, connector=self.name)

    # -- worker side ---------------------------------------------------------------------
    def bind_rank(self, rank: int, pp_rank: int, tp_rank: int) -> None:
        self.part = rank_part(self.config, pp_rank, tp_rank)
        self.injector.bind_rank(rank)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def _block_out(self, block_id: int) -> torch.Tensor:
        """A copy of this rank's part of a block, on the host: [layers, 2, block_size, kv_heads,
        head_dim]."""
        return torch.stack([cache[:, block_id] for cache in self._kv_caches]).cpu()

    def _block_in(self, block_id: int, kv: torch.Tensor) -> None:
        self._check_fits(kv)
        for layer, cache in enumerate(self._kv_caches):
            cache[:, block_id].copy_(kv[layer])

    def _part_bytes(self) -> int:
        """Bytes of this rank's part of a block."""
        cache = self._kv_caches[0]
        return len(self._kv_caches) * cache[:, 0].numel() * cache.element_size()

    def _count_dropped(self, blocks: int) -> None:
        with self._tally_lock:
            self._dropped += blocks

    def _count_transferred(self, saved: int = 0, loaded: int = 0) -> None:
        """Bytes whose save or load completed (this rank's parts)."""
        with self._tally_lock:
            self._transferred = (self._transferred[0] + saved, self._transferred[1] + loaded)

    def get_transferred(self) -> dict[str, tuple[int, int]]:
        with self._tally_lock:
            done, self._transferred = self._transferred, (0, 0)
        return {self.name: done} if any(done) else {}

    def get_dropped_saves(self) -> dict[str, int]:
        with self._tally_lock:
            dropped, self._dropped = self._dropped, 0
        return {self.name: dropped} if dropped else {}

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, BlockStoreMetadata):
            return
        self._load_errors |= self._load_blocks(meta.loads)
        for rid, loads in meta.async_loads.items():
            if self._io is None:
                self._io = ThreadPoolExecutor(1, thread_name_prefix="treadle-kv-load")
            # Nothing computes on top of these before they are done: no save to hold back.
            self._recving[rid] = self._io.submit(self._load_blocks, loads, self.load_delay_s,
                                                 False)

    def _load_blocks(self, loads: list[BlockTransfer], delay_s: float = 0.0,
                     hold_back_saves: bool = True) -> set[int]:
        """Loads blocks into the cache; returns the ids of those that failed."""
        if delay_s:
            time.sleep(delay_s)
        failed: set[int] = set()
        for load in loads:
            try:
                if self.injector.should_fail(load.index):
                    raise OSError("injected load failure")
                self._read_block(load)
                self.num_loaded_blocks += 1
                self._count_transferred(loaded=self._part_bytes())
            except Exception as e:   # missing, damaged or injected: each is a load error
                logger.warning("KV block %s failed to load into block %d: %s",
                               load.key[:12], load.block_id, e)
                self.num_failed_loads += 1
                failed.add(load.block_id)
                if hold_back_saves:
                    self._failed_reqs.add(load.req_id)
        return failed

    def failed_load_requests(self) -> set[str]:
        return set(self._failed_reqs)

    def hold_back_saves(self, req_ids: set[str]) -> None:
        self._failed_reqs |= req_ids

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Saves complete within their step; asynchronous loads report here when done (an
        aborted request's too: its blocks are held until then)."""
        self._failed_reqs -= finished_req_ids
        meta = self._metadata
        if self._recving and isinstance(meta, BlockStoreMetadata) and meta.poll_wait_s:
            wait(self._recving.values(), timeout=meta.poll_wait_s, return_when=FIRST_COMPLETED)
        done = {rid for rid, future in self._recving.items() if future.done()}
        for rid in done:
            self._load_errors |= self._recving.pop(rid).result()
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _check_fits(self, kv: torch.Tensor) -> None:
        """A stored block, [layers, 2, block_size, kv_heads, head_dim], fits this cache."""
        first = self._kv_caches[0]
        if len(kv) != len(self._kv_caches) or kv.shape[1:] != first[:, 0].shape or kv.dtype != first.dtype:
            raise ValueError(f"a block of {tuple(kv.shape)} {kv.dtype} does not fit this cache")


def crc32(kv: torch.Tensor) -> int:
    """The checksum every store keeps with a block (of its bytes, on the host)."""
    return zlib.crc32(kv.contiguous().view(torch.uint8).numpy())


def encode_block(kv: torch.Tensor) -> bytes:
    """A block as the shared-storage connector's files hold it: safetensors, its CRC32 in the
    metadata."""
    kv = kv.contiguous()
    return save_tensors({"kv": kv}, metadata={"crc32": str(crc32(kv))})


def decode_block(data: bytes) -> torch.Tensor:
    """The block `encode_block` wrote; ValueError if it is damaged."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        expected = int(json.loads(data[8:8 + header_len])["__metadata__"]["crc32"])
        kv = load_tensors(data)["kv"]
    except Exception as e:   # a damaged header or body reads as garbage of any kind
        raise ValueError(f"not a KV block: {e}") from None
    if crc32(kv) != expected:
        raise ValueError("checksum mismatch")
    return kv
