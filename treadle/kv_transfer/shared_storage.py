"""SharedStorageConnector: full KV blocks as files in a folder that engines share.

`kv_connector_extra_config={"shared_storage_path": DIR}`. Each full block of a request's known
tokens is one file, named by the block's prefix hash and what makes KV differ between engines:
the model, the dtype, the layer layout, the block size and the weights' identity (see
`engine/weights.py`; never the user's weight_version label). A producer saves
the blocks each step computes; a consumer, when it first schedules a request, loads the longest
run of stored blocks after its local prefix-cache hit: at the start of that step, or with
`"load_async": true` on a worker thread while the request waits for it.

A file is written under a temporary name and renamed, so a writer that dies mid-write leaves
no file a reader trusts; its checksum is verified on load, and a block that fails it (or is
missing, or fails by fault injection) is reported as a load error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from treadle.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorRole,
                                      LoadFaultInjector)

if TYPE_CHECKING:
    from treadle.config import TreadleConfig
    from treadle.core.scheduler_output import SchedulerOutput
    from treadle.request import Request

logger = logging.getLogger(__name__)


@dataclass
class BlockTransfer:
    req_id: str
    block_id: int      # where the block sits in the paged cache
    key: str           # its file name in the store
    index: int         # its position in its request (what fault injection counts)


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
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


class SharedStorageConnector(KVConnectorBase):
    required_extra_keys = ("shared_storage_path",)

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.root = Path(self.extra["shared_storage_path"])
        self.root.mkdir(parents=True, exist_ok=True)
        self.block_size = config.cache.block_size
        model = config.model
        self._layout = (os.path.realpath(model.model), str(model.dtype), model.num_layers,
                        model.num_kv_heads, model.head_dim, self.block_size)
        # Of the weights served: the engine's checkpoint until weights_changed() (the name
        # ServedWeights gives it).
        self.weights_identity = "checkpoint"
        # With "load_async": true, loads run on a worker thread while the engine steps on, and
        # their requests wait (WAITING_FOR_REMOTE_KVS) until they are done.
        self.load_async = bool(self.extra.get("load_async", False))
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[BlockTransfer] = []
        self._async_loads: dict[str, list[BlockTransfer]] = {}
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

    # -- naming --------------------------------------------------------------------------
    def block_key(self, block_hash: bytes) -> str:
        identity = repr((self._layout, self.weights_identity)).encode()
        return hashlib.sha256(identity + block_hash).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.kv"

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.is_consumer:
            return 0, False
        # Whole blocks after the local hit, leaving the last token to compute (its logits).
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        num_blocks = 0
        for block_hash in request.block_hashes[first:last]:
            if not self._path(self.block_key(block_hash)).exists():
                break
            num_blocks += 1
        return num_blocks * self.block_size, self.load_async and num_blocks > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        num_external = num_external_tokens // self.block_size
        loads = [BlockTransfer(request.request_id, block_ids[i],
                               self.block_key(request.block_hashes[i]), i)
                 for i in range(first, first + num_external)]
        if self.load_async and loads:
            self._async_loads[request.request_id] = loads
        else:
            self._loads += loads
        # A new tenancy starts: whatever was tracked for the id before (a preempted request,
        # reset or cut back by a failed load) is replaced.
        self._tracked[request.request_id] = _Tracked(request, list(block_ids), first + num_external,
                                                     self.weights_identity)

    def weights_changed(self, weights_identity: str) -> None:
        self.weights_identity = weights_identity

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._loads, async_loads=self._async_loads,
                                     poll_wait_s=0.0 if scheduler_output.num_scheduled_tokens
                                     else 0.005)
        self._loads, self._async_loads = [], {}
        # Tracking is not dropped by finished_req_ids: a request preempted there may have been
        # admitted again since, even in this very schedule (an asynchronous load puts it in
        # no step's new requests). It ends in request_finished or update_state_after_alloc.
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            self._tracked[rid].block_ids += block_ids
        for new in scheduler_output.scheduled_new_reqs:   # maybe back from an asynchronous load
            tracked = self._tracked[new.req_id]
            tracked.block_ids = list(new.block_ids)
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
                meta.saves.append(BlockTransfer(rid, tracked.block_ids[i],
                                                self.block_key(request.block_hashes[i]), i))
            tracked.num_handled = max(tracked.num_handled, num_full)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        """Saves finish within their step: nothing to wait for. A producer tells the decode
        side where its KV went and how many of the request's blocks are stored."""
        tracked = self._tracked.pop(request.request_id, None)
        if not self.is_producer or tracked is None:
            return False, None
        return False, {"shared_storage_path": str(self.root), "num_stored_blocks": tracked.num_handled}

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata):
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
            except Exception as e:   # missing, damaged or injected: each is a load error
                logger.warning("KV block %s failed to load into block %d: %s",
                               load.key[:12], load.block_id, e)
                self.num_failed_loads += 1
                failed.add(load.block_id)
                if hold_back_saves:
                    self._failed_reqs.add(load.req_id)
        return failed

    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata):
            return
        for save in meta.saves:
            if save.req_id not in self._failed_reqs and not self._path(save.key).exists():
                self._write_block(save)
                self.num_saved_blocks += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Saves complete within their step; asynchronous loads report here when done (an
        aborted request's too: its blocks are held until then)."""
        self._failed_reqs -= finished_req_ids
        meta = self._metadata
        if self._recving and isinstance(meta, SharedStorageMetadata) and meta.poll_wait_s:
            wait(self._recving.values(), timeout=meta.poll_wait_s, return_when=FIRST_COMPLETED)
        done = {rid for rid, future in self._recving.items() if future.done()}
        for rid in done:
            self._load_errors |= self._recving.pop(rid).result()
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _write_block(self, save: BlockTransfer) -> None:
        # [layers, 2, block_size, kv_heads, head_dim]
        kv = torch.stack([cache[:, save.block_id] for cache in self._kv_caches]).cpu().contiguous()
        data = save_tensors({"kv": kv}, metadata={"crc32": str(_crc32(kv))})
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(save.key))   # atomic: readers see all of it or nothing
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_block(self, load: BlockTransfer) -> None:
        with safe_open(str(self._path(load.key)), framework="pt") as f:
            expected = int(f.metadata()["crc32"])
            kv = f.get_tensor("kv")
        if _crc32(kv) != expected:
            raise ValueError("checksum mismatch")
        first = self._kv_caches[0]
        if len(kv) != len(self._kv_caches) or kv.shape[1:] != first[:, 0].shape or kv.dtype != first.dtype:
            raise ValueError(f"a block of {tuple(kv.shape)} {kv.dtype} does not fit this cache")
        for layer, cache in enumerate(self._kv_caches):
            cache[:, load.block_id].copy_(kv[layer])


def _crc32(kv: torch.Tensor) -> int:
    return zlib.crc32(kv.contiguous().view(torch.uint8).numpy())
