"""RedisConnector: KV blocks in a Redis server that engine instances, on any hosts, share.

`{"kv_connector": "RedisConnector", "kv_connector_extra_config": {"url": "redis://host:port/db",
  "ttl_s": 3600}}`. Through redis-py (`pip install 'treadle[redis]'`). Options:
- `url`: redis://[user:password@]host:port/db, rediss:// (TLS) or unix:///path.sock?db=N;
- `ttl_s`: each block expires this long after it was saved, last loaded, or last served by
  an instance's own prefix cache (default: never);
- `timeout_s` (0.25): the longest one call to Redis may take, connecting included;
- `retry_interval_s` (1.0): after Redis could not be reached, how long every call fails at
  once before one tries again;
- `max_pending_saves` (256): blocks copied out and waiting for the saver thread; past that a
  save is dropped;
- `key_prefix` ("treadle:kv:").

Each value is a block (with pipeline or tensor parallelism, one rank's part of it) exactly as
the shared-storage connector's files hold it: safetensors with its CRC32, verified on load. Its
key is the prefix, the block key of `block_store.py` (prefix hash, model, dtype, layer layout,
block size, weights' identity) and the rank's part, so instances of one model and weights
share blocks and never read another's. The model is named by a digest of its checkpoint's
files (config and weights, read once at start-up), not by its path: copies of one checkpoint
on several hosts share blocks, and other weights at the same path never do.

What Redis keeps is bounded by the TTL and by the server's `maxmemory` with an eviction policy
(`allkeys-lru` or `volatile-ttl`, say): a block evicted there is a miss, or a failed load
recomputed exactly. Under `noeviction` a full server refuses writes: they count as dropped saves.

Nothing waits long on Redis: a lookup (EXISTS, on the scheduler side) and a load (GET, or GETEX
refreshing the TTL, at the start of the step) take at most `timeout_s`, without retries; a
save is copied out of the cache in its step and written by a thread of its own (SET NX), through
a bounded queue. When Redis is down (at start or mid-run) lookups miss, loads fail and follow
`kv_load_failure_policy`, and saves are dropped, counted, with one warning per outage; calls try
again every `retry_interval_s`, so the engine uses Redis again as soon as it is back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar
from urllib.parse import urlsplit

import torch

from treadle.validate import check_seconds
from treadle.kv_transfer.base import KVConnectorRole
from treadle.kv_transfer.block_store import (BlockStoreConnector, BlockStoreMetadata,
                                             BlockTransfer, decode_block, encode_block)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:   # the `redis` extra is not installed: check_config says so
    redis = None

if TYPE_CHECKING:
    from treadle.config import KVTransferConfig, TreadleConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
SAVE_BATCH = 32   # blocks the saver writes in one pipeline


@dataclass(frozen=True)
class RedisOptions:
    url: str
    ttl_s: float | None = None
    timeout_s: float = 0.25
    retry_interval_s: float = 1.0
    max_pending_saves: int = 256
    key_prefix: str = "treadle:kv:"

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> RedisOptions:
        """The options of `kv_connector_extra_config`, each checked (a ValueError names it)."""
        if redis is None:
            raise ValueError("kv_connector RedisConnector needs redis-py: pip install 'treadle[redis]'")
        name = "kv_transfer_config.kv_connector_extra_config"
        url = extra["url"]
        if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{name}.url must be redis://host:port/db, rediss://... or "
                             f"unix://path, got {url!r}")

        def seconds(key: str, default: float | None, zero_ok: bool = False) -> float | None:
            value = extra.get(key, default)
            if value is None and default is None:
                return None   # optional, not given
            return check_seconds(f"{name}.{key}", value, zero_ok)

        pending = extra.get("max_pending_saves", cls.max_pending_saves)
        if isinstance(pending, bool) or not isinstance(pending, int) or pending < 1:
            raise ValueError(f"{name}.max_pending_saves must be an int >= 1, got {pending!r}")
        prefix = extra.get("key_prefix", cls.key_prefix)
        if not isinstance(prefix, str):
            raise ValueError(f"{name}.key_prefix must be a string, got {prefix!r}")
        return cls(url, seconds("ttl_s", None), seconds("timeout_s", cls.timeout_s),
                   seconds("retry_interval_s", cls.retry_interval_s, zero_ok=True), pending, prefix)


class RedisUnavailable(Exception):
    """Redis could not be reached (now, or within the last retry interval)."""


class RedisLink:
    """A redis-py client that fails fast: each call within `timeout_s`, never retried; after a
    connection error every call fails at once for `retry_interval_s`, then one tries again.
    One warning when Redis goes away, one line when it is back. Thread-safe."""

    def __init__(self, options: RedisOptions, role: str) -> None:
        self.client = redis.Redis.from_url(
            options.url, socket_timeout=options.timeout_s,
            socket_connect_timeout=options.timeout_s, retry=Retry(NoBackoff(), 0))
        parts = urlsplit(options.url)
        self.where = f"{parts.scheme}://{parts.hostname or ''}:{parts.port or ''}{parts.path}"
        self.role = role
        self.retry_interval_s = options.retry_interval_s
        self._lock = threading.Lock()
        self._down = False
        self._retry_at = 0.0

    @property
    def is_down(self) -> bool:
        return self._down and time.monotonic() < self._retry_at

    def run(self, call: Callable[[Any], T]) -> T:
        """`call(client)`; RedisUnavailable if Redis cannot be reached."""
        if self.is_down:
            raise RedisUnavailable(f"Redis at {self.where} is unreachable")
        try:
            result = call(self.client)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            with self._lock:
                if not self._down:
                    logger.warning("Redis at %s is unreachable (%s): the %s side misses, fails "
                                   "its loads and drops its saves, trying again every %.1f s",
                                   self.where, e, self.role, self.retry_interval_s)
                self._down = True
                self._retry_at = time.monotonic() + self.retry_interval_s
            raise RedisUnavailable(f"Redis at {self.where} is unreachable: {e}") from None
        if self._down:
            with self._lock:
                if self._down:
                    logger.info("Redis at %s is reachable again (%s side)", self.where, self.role)
                self._down = False
        return result


class RedisConnector(BlockStoreConnector):
    required_extra_keys = ("url",)

    @classmethod
    def check_config(cls, transfer: KVTransferConfig) -> None:
        RedisOptions.from_extra(transfer.kv_connector_extra_config)

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.options = RedisOptions.from_extra(self.extra)
        self.link = RedisLink(self.options, role.name.lower())
        self._name_model_by_contents()
        self._ttl_ms = None if self.options.ttl_s is None else max(1, int(self.options.ttl_s * 1000))
        # Worker side: blocks copied out of the cache, for the saver thread.
        self._pending: queue.Queue[tuple[str, torch.Tensor]] = queue.Queue(self.options.max_pending_saves)
        self._saver: threading.Thread | None = None
        self._warned_full = False
        self._warned_refused = False

    def _name(self, key: str, part: str) -> str:
        return f"{self.options.key_prefix}{key}{part}"

    # -- scheduler side ------------------------------------------------------------------
    def _contains(self, key: str) -> bool:
        return self._num_stored([key]) == 1

    def _lookup(self, block_hashes: list, first: int, last: int, keep_head: bool) -> int:
        if self._ttl_ms is None or not keep_head:
            return super()._lookup(block_hashes, first, last, keep_head)
        # The blocks this instance's own prefix cache serves are never loaded from Redis, so
        # no GETEX renews them: without a renewal here, the prefixes it uses most (a system
        # prompt) would expire for every other instance while they are hot here.
        return self._num_stored([self.block_key(h) for h in block_hashes[first:last]],
                                renew=[self.block_key(h) for h in block_hashes[:first]])

    def _num_stored(self, keys: list[str], renew: list[str] = ()) -> int:
        """One round trip: which blocks have every rank's part; the `renew` blocks' parts
        expire ttl_s from now."""
        if not keys and not renew:
            return 0

        def exists(client: Any) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(*(self._name(key, part) for part in self.parts))
            for key in renew:
                for part in self.parts:
                    pipe.pexpire(self._name(key, part), self._ttl_ms)
            return pipe.execute()[:len(keys)]

        try:
            counts = self.link.run(exists)
        except (RedisUnavailable, redis.RedisError):
            return 0   # a miss: the request computes these blocks
        return next((i for i, n in enumerate(counts) if n < len(self.parts)), len(keys))

    # -- worker side ---------------------------------------------------------------------
    def _read_block(self, load: BlockTransfer) -> None:
        name = self._name(load.key, self.part)
        ttl = self._ttl_ms
        try:
            data = self.link.run(lambda c: c.getex(name, px=ttl) if ttl else c.get(name))
        except redis.ResponseError as e:   # WRONGTYPE: a value of another type under its name
            self._drop_damaged(name)
            raise ValueError(f"{name} holds no block: {e}") from e
        if data is None:
            raise KeyError(f"{name} is not in Redis (expired or evicted)")
        try:
            kv = decode_block(data)
        except ValueError:
            self._drop_damaged(name)
            raise
        self._block_in(load.block_id, kv)

    def _drop_damaged(self, name: str) -> None:
        """No one else should load it, and a save may then replace it (saves are SET NX)."""
        try:
            self.link.run(lambda c: c.delete(name))
        except (RedisUnavailable, redis.RedisError):
            pass

    def wait_for_save(self) -> None:
        """Copies this step's saves out of the cache (the next step may overwrite the blocks)
        and queues them for the saver thread; nothing here waits for Redis."""
        meta = self._metadata
        if not isinstance(meta, BlockStoreMetadata):
            return
        saves = [s for s in meta.saves if s.req_id not in self._failed_reqs]
        if not saves:
            return
        if self.link.is_down:   # no copy of what would be dropped anyway
            self._count_dropped(len(saves))
            return
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="treadle-kv-redis-save",
                                           daemon=True)
            self._saver.start()
        for save in saves:
            try:
                self._pending.put_nowait((self._name(save.key, self.part),
                                          self._block_out(save.block_id)))
            except queue.Full:
                if not self._warned_full:
                    logger.warning("Redis at %s takes saves slower than blocks are computed: "
                                   "dropping saves past %d pending (counted in dropped_saves)",
                                   self.link.where, self.options.max_pending_saves)
                    self._warned_full = True
                self._count_dropped(1)

    def _save_loop(self) -> None:
        """The saver thread: writes queued blocks in batches, one pipeline each."""
        while True:
            batch = [self._pending.get()]
            while len(batch) < SAVE_BATCH:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
                self.num_saved_blocks += len(batch)
                self._count_transferred(saved=len(batch) * self._part_bytes())
            except (RedisUnavailable, redis.RedisError) as e:
                # Down: the link warned once. Refused (a full server under `noeviction`):
                # warned once here. Either way the blocks are counted as dropped.
                if not isinstance(e, RedisUnavailable) and not self._warned_refused:
                    logger.warning("Redis at %s refused KV saves: %s (counted in dropped_saves)",
                                   self.link.where, e)
                    self._warned_refused = True
                self._count_dropped(len(batch))
            finally:
                for _ in batch:
                    self._pending.task_done()

    def _write(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        values = [(name, encode_block(kv)) for name, kv in batch]   # checksummed here, off the step

        def write(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(name, value, nx=True, px=self._ttl_ms)
            pipe.execute()

        self.link.run(write)

    def flush(self) -> None:
        """Wait until every queued save is written or dropped (tests, orderly shutdown)."""
        self._pending.join()
