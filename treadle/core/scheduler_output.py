"""Messages between the scheduler and the workers, one pair per step, and what a step hands
the engine for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treadle.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have no slot for: first schedule, or resumed after preemption."""

    req_id: str
    token_ids: list[int]          # prompt + any output already generated
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # Per KV cache group (core/kv_cache_groups.py); 0 (the null block) for blocks given back
    # behind the window.
    block_ids: list[list[int]]
    num_computed_tokens: int      # before this step (prefix hits included)
    generator_seed: int           # per-request RNG seed; the same sample whatever the batch
    eos_token_id: int | None = None
    long_rope: bool = False       # its RoPE takes LongRoPE's long factors (Request.long_rope)
    grammar_waits_for: tuple[int, ...] = ()   # Request.grammar_waits_for


@dataclass
class CachedRequestData:
    """Requests the workers already hold: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[list[int]]] = field(default_factory=list)   # per KV cache group
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    # How many leading blocks each request has given back behind the sliding window, per KV
    # cache group (its table's first entries, now the null block's): the workers point them at
    # the null block before the step runs, as another request may write those blocks in it.
    num_null_blocks: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose slots the workers must drop before this step (finished or preempted).
    finished_req_ids: set[str] = field(default_factory=set)
    # Per request that samples this step: how many output tokens it puts in flight (1 + drafts).
    # A prefill chunk that is not the last one samples nothing and is absent. The keys are the
    # one decision of who samples: the scheduler makes it, the runner obeys it, and a sampling
    # request that comes back with no token is an engine error.
    num_in_flight_tokens: dict[str, int] = field(default_factory=dict)
    # Draft tokens to verify, per request; they follow its last known token in the step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The KV connector's instructions for the workers this step (KVConnectorMetadata).
    kv_connector_metadata: Any = None
    # Scheduler-side record of this step's KV loads: request -> (index of its first loaded
    # block, the loaded block ids, its Request.tenancy then: which tenancy of its id and blocks).
    # Settled when the step returns (core/kv_load_recovery.py).
    kv_loads: dict[str, tuple[int, list[int], int]] = field(default_factory=dict)
    # The same for loads started this step that finish asynchronously, in a later step's
    # KVConnectorOutput.finished_recving; their requests compute nothing meanwhile.
    async_kv_loads: dict[str, tuple[int, list[int], int]] = field(default_factory=dict)
    # Requests whose blocks a connector still writes or reads (Scheduler.num_kv_transfers): a
    # step with no tokens still goes to the workers while there are any, to hear them done.
    num_kv_transfers: int = 0
    # The connector could not tell yet what it can load for the next waiting request: an
    # empty step is then a wait, not a stall.
    waiting_for_connector: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and self.num_kv_transfers == 0


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled (or prompt) position: ids[0] is the chosen token."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int                      # rank of ids[0] among the full vocabulary


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request, the tokens sampled this step; empty for a prefill chunk that is not the last.
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request: (index of the first prompt token covered, logprobs of the prompt tokens this
    # chunk predicts). Keyed by position so a chunk recomputed after preemption just overwrites.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Per request: drafts proposed for its next step (speculative decoding).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests the runner ends, with why: a grammar that allows no next token. Their tokens of
    # this step are not output; the scheduler finishes them with finish_reason "error".
    request_errors: dict[str, str] = field(default_factory=dict)
    # What the KV connector's worker side reported (KVConnectorOutput), if there is one.
    kv_connector_output: Any = None

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls(req_ids=[], sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None   # arrival to first schedule, seconds
    kv_transfer_params: dict | None = None   # from the KV connector, on the final output
