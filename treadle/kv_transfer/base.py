"""The KV connector interface: how KV crosses the engine's boundary (offload, disaggregation).

Modelled on vLLM's V1 connector API, so connectors written against it feel familiar. One class
serves two roles, each instance one of them:
- the scheduler side decides which tokens' KV can be loaded from outside and which blocks to
  save, and says so each step in a metadata object that travels with the SchedulerOutput;
- the worker side moves the bytes between the paged KV cache and the outside, and reports
  what finished and which blocks failed to load.

Loads are synchronous here: a block is loaded at the start of the step that first schedules
its request, before any attention reads it. A block that fails to load is reported after the
step, and the scheduler recovers by the rule in `core/kv_load_recovery.py`.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from treadle.config import KVTransferConfig, TreadleConfig
    from treadle.core.scheduler_output import SchedulerOutput
    from treadle.core.stats import KVTierStats
    from treadle.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step; each connector extends it."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step."""

    finished_sending: set[str] = field(default_factory=set)    # requests whose saves are done
    finished_recving: set[str] = field(default_factory=set)    # requests whose loads are done
    invalid_block_ids: set[int] = field(default_factory=set)   # blocks whose load failed
    # Per connector (its class name): block saves dropped since the last report.
    dropped_saves: dict[str, int] = field(default_factory=dict)
    # Per connector: (bytes saved, bytes loaded) that completed since the last report, each
    # rank's part of a block counted by that rank (the aggregator sums the ranks).
    transferred: dict[str, tuple[int, int]] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.dropped_saves or self.transferred)


class KVConnectorBase:
    """A connector; subclasses implement the methods of the roles they support."""

    # Keys that `kv_connector_extra_config` must hold; checked before any model loads.
    required_extra_keys: tuple[str, ...] = ()

    @classmethod
    def check_config(cls, transfer: KVTransferConfig) -> None:
        """Refuse a bad `kv_connector_extra_config` (a ValueError naming the field), before
        any model loads; required_extra_keys are checked already."""

    @classmethod
    def host_bytes(cls, transfer: KVTransferConfig) -> int:
        """Host memory this connector allocates whole at start-up (checked against what is
        available, before any model loads)."""
        return 0

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self.transfer_config = config.kv_transfer
        self.extra = dict(self.transfer_config.kv_connector_extra_config)
        self._metadata: KVConnectorMetadata | None = None
        # Its stats' and metrics' label, and its key for reports from the workers: the class's
        # name (MultiConnector numbers a class it holds more than once).
        self.name = type(self).__name__

    @property
    def is_producer(self) -> bool:
        return self.transfer_config.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.transfer_config.kv_role in ("kv_consumer", "kv_both")

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """How many tokens after the first `num_computed_tokens` can be loaded from outside,
        and whether the load is asynchronous. None: ask again later. No side effects."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request got blocks; the first of `block_ids` hold its `num_external_tokens`."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the worker side; resets the per-step state."""
        return KVConnectorMetadata()

    def weights_changed(self, weights_identity: str) -> None:
        """The engine serves other weights from now on (steps drained). KV is keyed by their
        identity; requests that hold KV from before never save any more of theirs, since all of
        it depends on the old weights."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker side reported for a step."""

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended: (keep its blocks until the connector reports them sent, the
        kv_transfer_params to hand back to the client)."""
        return False, None

    def get_stats(self) -> list[KVTierStats]:
        """Counters of the stores behind this connector, for `LLM.get_stats()` and /metrics."""
        return []

    # -- worker side ---------------------------------------------------------------------
    def bind_rank(self, rank: int, pp_rank: int, tp_rank: int) -> None:
        """The worker rank this connector moves KV for: its stage's layers, its KV heads."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The paged cache, one tensor per layer: [2, num_blocks, block_size, kv_heads, head_dim]."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def wait_for_cache_reads(self) -> None:
        """Return once earlier steps' saves no longer read the cache: another connector's
        loads (MultiConnector) are about to write it, maybe into a block such a save still
        copies out of."""

    def start_load_kv(self) -> None:
        """Start loading this step's blocks (before the forward pass)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s KV for this step is in place."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Start saving `layer`'s KV for this step (after the layer has written it)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done (or handed off, for asynchronous savers)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests done sending, requests done receiving) since the last call."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        return set()

    def get_dropped_saves(self) -> dict[str, int]:
        """Per connector: block saves dropped since the last call."""
        return {}

    def get_transferred(self) -> dict[str, tuple[int, int]]:
        """Per connector: (bytes saved, bytes loaded) that completed since the last call."""
        return {}

    def failed_load_requests(self) -> set[str]:
        """Requests whose load failed and whose saves are held back until they are reset."""
        return set()

    def hold_back_saves(self, req_ids: set[str]) -> None:
        """Save nothing more of these requests until they are reset: a load failed for them
        elsewhere (another connector of a MultiConnector)."""


class LoadFaultInjector:
    """Fails block loads on purpose, so users can rehearse failures and tests can cause them.

    From `kv_connector_extra_config`: `inject_load_failure_rate` (fraction of block loads that
    fail), `inject_seed`, `inject_failed_block_indices` (block positions within a request,
    counted from its first block, whose loads always fail), and `inject_failure_ranks` (the
    worker ranks that inject; default all).
    """

    def __init__(self, extra: dict[str, Any]) -> None:
        self.rate = float(extra.get("inject_load_failure_rate", 0.0))
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"kv_connector_extra_config.inject_load_failure_rate must be in "
                             f"[0, 1], got {self.rate}")
        self.indices = {int(i) for i in extra.get("inject_failed_block_indices", ())}
        self._rng = random.Random(extra.get("inject_seed", 0))
        ranks = extra.get("inject_failure_ranks")
        self.ranks = None if ranks is None else {int(r) for r in ranks}
        self.active = True
        self.num_injected = 0

    def bind_rank(self, rank: int) -> None:
        self.active = self.ranks is None or rank in self.ranks

    def should_fail(self, block_index: int) -> bool:
        if not self.active:
            return False
        fail = block_index in self.indices or (self.rate > 0 and self._rng.random() < self.rate)
        self.num_injected += fail
        return fail
