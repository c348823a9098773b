"""A request as the engine core sees it: token ids, progress counters and status."""

from __future__ import annotations

import enum
import hashlib
import pickle
import time

from treadle.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3   # holds its blocks while a connector loads its KV
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple) -> BlockHash:
    """Content hash of one full block, chained to its parent so equal hashes mean equal prefixes."""
    return hashlib.sha256(pickle.dumps((parent, token_ids, extra_keys), protocol=5)).digest()


class Request:
    """Engine-core state of one sequence.

    Counters:
      num_tokens: prompt + output tokens known so far (len(all_token_ids)).
      num_computed_tokens: tokens whose KV is in the cache or is being computed by a step
        already scheduled, draft tokens included. The scheduler advances it when it schedules,
        not when the step returns, and takes back rejected drafts when the step returns.
      num_output_placeholders: output tokens that scheduled steps may still deliver (1 + drafts
        per sampling step). Never a flag: async scheduling keeps up to two steps in flight.
      num_stale_output_tokens: in-flight output from before a preemption or reset; exactly
        this many arriving tokens are dropped. Zero whenever nothing was in flight.
      num_in_flight_steps: steps scheduled for it and not yet returned (a non-final prefill
        chunk counts too); a finished request's are dropped on arrival by the scheduler.
      num_in_flight_drafts: draft tokens among the placeholders; the request is not scheduled
        again until they are verified, since the next position depends on how many survive.
      num_cached_tokens: prefix-cache hit length at the first schedule (-1 before it).
      tenancy: which tenancy of its id and blocks this is, set by the scheduler on every add
        and preemption and unique within it. Work in flight (a step's KV load) is matched to
        the request by it, never by the id alone: clients reuse ids.
      client_id: the id the client gave (request_id is the engine's: engine/input_processor.py),
        shown where people look (the console), never used to match anything.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_size: int = 16,
        client_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_id = request_id if client_id is None else client_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.max_tokens: int = sampling_params.max_tokens or 0  # set by the engine when None

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_stale_output_tokens = 0
        self.num_in_flight_drafts = 0
        self.num_in_flight_steps = 0
        self.spec_token_ids: list[int] = []   # drafts proposed for the next step
        self.num_cached_tokens = -1
        self.queue_time: float | None = None   # seconds from arrival to the first schedule
        self.num_preemptions = 0
        self.tenancy = -1
        # Set when a KV load for it failed: it recomputes locally and is not offered external
        # KV again. kv_transfer_params: what the client passed for the connector, and once it
        # finishes, what the connector hands back (for the decode side of a P/D pair).
        self.kv_load_failed = False
        self.kv_transfer_params: dict | None = (sampling_params.extra_args or {}).get(
            "kv_transfer_params")

        # Whether its KV takes LongRoPE's long factors (models/rope.py): set by the scheduler
        # when it starts, or restarts, past the model's original context; never unset.
        self.long_rope = False
        # The tokens that end its reasoning, which its grammar waits for before it binds
        # (structured_output/reasoning.py); empty: the grammar binds from the first token.
        self.grammar_waits_for: tuple[int, ...] = ()

        self._block_size = block_size
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    # -- sizes -----------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need logits at every prompt position, so nothing may be skipped.
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def use_long_rope(self) -> None:
        """From now on its KV is computed with LongRoPE's long factors: its blocks' keys change,
        so no block computed with the short ones is ever taken for one of its own."""
        assert self.num_computed_tokens == 0, "only a request with nothing computed changes RoPE"
        self.long_rope = True
        self.block_hashes = []
        self._update_block_hashes()

    # -- prefix-cache keys -----------------------------------------------------
    def _update_block_hashes(self) -> None:
        bs = self._block_size
        start = len(self.block_hashes)
        if len(self.all_token_ids) < (start + 1) * bs:
            return   # most new tokens fill no block
        # Tagged, so that no salt can spell another key ("long_rope" as a salt is a salt).
        first_keys = ((("cache_salt", self.cache_salt),) if self.cache_salt else ()) + (
            ("long_rope",) if self.long_rope else ())
        for i in range(start, self.num_tokens // bs):
            parent = self.block_hashes[i - 1] if i > 0 else None
            # The salt goes into the first block only; chaining carries it to the rest.
            extra = first_keys if i == 0 else ()
            self.block_hashes.append(hash_block(parent, tuple(self.all_token_ids[i * bs:(i + 1) * bs]), extra))

