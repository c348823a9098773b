"""MultiConnector: several connectors as tiers, e.g. host memory, then shared storage.

`{"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config":
  {"connectors": [{"kv_connector": ..., "kv_connector_extra_config": {...}}, ...]}}`, as vLLM
configures it. A connector's spec without `kv_role` takes the MultiConnector's;
`kv_load_failure_policy` is the MultiConnector's for all of them.

Loads: every connector is asked how many tokens past the local prefix hit it can load, and one
of them loads them all: the one with the longest run, the earliest in the list on a tie (list
the fastest tier first). vLLM takes the first with any hit; taking the longest means a short
run in host memory never hides a longer one further down. If any connector cannot tell yet,
the request is asked about again later. Saves: each connector saves what it does not hold yet,
so a block loaded from a later tier is saved into the earlier ones. A load that fails in one
connector holds back the request's saves in all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from treadle.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                      KVConnectorRole)
from treadle.kv_transfer.registry import connector_class

if TYPE_CHECKING:
    from treadle.config import KVTransferConfig, TreadleConfig
    from treadle.core.scheduler_output import SchedulerOutput
    from treadle.core.stats import KVTierStats
    from treadle.request import Request


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    metas: list[KVConnectorMetadata] = field(default_factory=list)   # one per connector


def sub_configs(transfer: KVTransferConfig) -> list[KVTransferConfig]:
    """The connectors' own configs, each checked as a kv_transfer_config is."""
    from treadle.config import KVTransferConfig

    specs = transfer.kv_connector_extra_config["connectors"]
    if not isinstance(specs, list) or not specs:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.connectors must be a "
                         "non-empty list of kv_transfer_configs")
    subs = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ValueError(f"kv_connector_extra_config.connectors[{i}] must be a dict")
        if spec.get("kv_connector") == "MultiConnector":
            raise ValueError(f"kv_connector_extra_config.connectors[{i}] cannot be a MultiConnector")
        spec = {"kv_role": transfer.kv_role, **spec,
                "kv_load_failure_policy": transfer.kv_load_failure_policy}
        subs.append(KVTransferConfig.from_dict(spec))
    return subs


class MultiConnector(KVConnectorBase):
    required_extra_keys = ("connectors",)

    @classmethod
    def check_config(cls, transfer: KVTransferConfig) -> None:
        sub_configs(transfer)

    @classmethod
    def host_bytes(cls, transfer: KVTransferConfig) -> int:
        return sum(connector_class(sub.kv_connector).host_bytes(sub) for sub in sub_configs(transfer))

    def __init__(self, config: TreadleConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.connectors: list[KVConnectorBase] = [
            connector_class(sub.kv_connector)(dataclasses.replace(config, kv_transfer=sub), role)
            for sub in sub_configs(self.transfer_config)]
        # Two tiers of one class (a local Redis and a shared one) are told apart: "X", "X#2".
        seen: dict[str, int] = {}
        for c in self.connectors:
            seen[c.name] = seen.get(c.name, 0) + 1
            if seen[c.name] > 1:
                c.name = f"{c.name}#{seen[c.name]}"
        self._chosen: dict[str, int] = {}   # request -> the connector that loads for it

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        answers = []
        for c in self.connectors:
            num, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num is None:
                return None, False
            answers.append((num, load_async))
        best = max(range(len(answers)), key=lambda i: (answers[i][0], -i))
        if answers[best][0] == 0:
            self._chosen.pop(request.request_id, None)
            return 0, False
        self._chosen[request.request_id] = best
        return answers[best]

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiConnectorMetadata:
        return MultiConnectorMetadata([c.build_connector_meta(scheduler_output)
                                       for c in self.connectors])

    def weights_changed(self, weights_identity: str) -> None:
        for c in self.connectors:
            c.weights_changed(weights_identity)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are kept while any connector still sends them; the params are all of theirs
        (the earlier connector's on a clash)."""
        delay, params = False, None
        for c in reversed(self.connectors):
            keep, p = c.request_finished(request, block_ids)
            delay |= keep
            if p is not None:
                params = {**(params or {}), **p}
        return delay, params

    def get_stats(self) -> list[KVTierStats]:
        return [s for c in self.connectors for s in c.get_stats()]

    # -- worker side ---------------------------------------------------------------------
    def bind_rank(self, rank: int, pp_rank: int, tp_rank: int) -> None:
        for c in self.connectors:
            c.bind_rank(rank, pp_rank, tp_rank)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        metas = (metadata.metas if isinstance(metadata, MultiConnectorMetadata)
                 else [metadata] * len(self.connectors))
        for c, meta in zip(self.connectors, metas):
            c.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for c in self.connectors:
            c.clear_connector_metadata()

    def start_load_kv(self) -> None:
        # A block freed last step may be loaded into now while another connector's save still
        # copies out of it (the host tier copies on a thread of its own): every save lets go
        # of the cache before any connector loads. (Each connector waits for its own saves.)
        for c in self.connectors:
            c.wait_for_cache_reads()
        for c in self.connectors:
            c.start_load_kv()
        # What a request computes on a failed load is wrong: no connector may save it.
        self.hold_back_saves(self.failed_load_requests())

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer, kv_layer)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """A request's load is one connector's; its blocks are sent once no connector keeps
        them (none of ours keeps any after the step that saved them)."""
        sending, recving = set(), set()
        for c in self.connectors:
            s, r = c.get_finished(finished_req_ids)
            sending |= s
            recving |= r
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.connectors))

    def get_dropped_saves(self) -> dict[str, int]:
        return {k: v for c in self.connectors for k, v in c.get_dropped_saves().items()}

    def get_transferred(self) -> dict[str, tuple[int, int]]:
        return {k: v for c in self.connectors for k, v in c.get_transferred().items()}

    def failed_load_requests(self) -> set[str]:
        return set().union(*(c.failed_load_requests() for c in self.connectors))

    def hold_back_saves(self, req_ids: set[str]) -> None:
        for c in self.connectors:
            c.hold_back_saves(req_ids)
