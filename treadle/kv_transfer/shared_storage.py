"""SharedStorageConnector: full KV blocks as files in a folder that engines share.

`kv_connector_extra_config={"shared_storage_path": DIR}`. Each full block of a request's known
tokens is one file, named by its key (`block_store.py`: the prefix hash, model, dtype, layer
layout, block size and weights' identity). A producer saves the blocks each step computes; a
consumer, when it first schedules a request, loads the longest run of stored blocks after its
local prefix-cache hit: at the start of that step, or with `"load_async": true` on a worker
thread while the request waits for it.

A file is written under a temporary name and renamed, so a writer that dies mid-write leaves
no file a reader trusts; its checksum is verified on load, and a block that fails it (or is
missing, or fails by fault injection) is reported as a load error. With pipeline or tensor
parallelism each rank writes its part of a block as a file of its own (`{key}{part}.kv`), and a
block is stored once every part is.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.kv_transfer.block_store import (BlockStoreConnector, BlockStoreMetadata,
                                             BlockTransfer, _Tracked, decode_block, encode_block)

if TYPE_CHECKING:
    from treadle.config import TreadleConfig
    from treadle.kv_transfer.base import KVConnectorRole

# The names this connector's users and tests know.
SharedStorageMetadata = BlockStoreMetadata
__all__ = ["BlockTransfer", "SharedStorageConnector", "SharedStorageMetadata"]


class SharedStorageConnector(BlockStoreConnector):
    required_extra_keys = ("shared_storage_path",)

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.root = Path(self.extra["shared_storage_path"])
        self.root.mkdir(parents=True, exist_ok=True)
        self._name_model_by_contents()   # another instance may read the folder later

    def _path(self, key: str, part: str | None = None) -> Path:
        """The file of a rank's part of a block (this worker's by default)."""
        return self.root / f"{key}{self.part if part is None else part}.kv"

    # -- scheduler side ------------------------------------------------------------------
    def _contains(self, key: str) -> bool:
        return all(self._path(key, part).exists() for part in self.parts)

    def _wants(self, key: str) -> bool:
        return not self._contains(key)

    def _transfer_params(self, tracked: _Tracked) -> dict[str, Any] | None:
        """A producer tells the decode side where its KV went and how many of the request's
        blocks are stored."""
        return {"shared_storage_path": str(self.root), "num_stored_blocks": tracked.num_handled}

    # -- worker side ---------------------------------------------------------------------
    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, BlockStoreMetadata):
            return
        for save in meta.saves:
            if save.req_id not in self._failed_reqs and not self._path(save.key).exists():
                self._write_block(save)
                self.num_saved_blocks += 1
                self._count_transferred(saved=self._part_bytes())

    def _write_block(self, save: BlockTransfer) -> None:
        data = encode_block(self._block_out(save.block_id))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(save.key))   # atomic: readers see all of it or nothing
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_block(self, load: BlockTransfer) -> None:
        path = self._path(load.key)
        try:
            kv = decode_block(path.read_bytes())
        except ValueError:
            # Damaged: gone, so that no later request fails on it, and a producer (which saves
            # only the blocks whose file is missing) writes it again, as RedisConnector does.
            path.unlink(missing_ok=True)
            raise
        self._block_in(load.block_id, kv)
