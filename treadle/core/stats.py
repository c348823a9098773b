"""What the engine reports about itself: scheduler state and speculative decoding acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0            # steps in which a request verified drafts
    num_draft_tokens: int = 0      # drafts verified
    num_accepted_tokens: int = 0   # drafts kept
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verifying step: the accepted drafts plus the bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class KVTierStats:
    """One KV connector's store, counted by its scheduler side; blocks, bytes and counters are
    totals since start-up, except the two gauges at the end."""

    connector: str                 # its kv_connector name
    hits: int = 0                  # blocks past the local prefix hit that it was asked to load
    misses: int = 0                # blocks past the local prefix hit that it did not have
    failed_loads: int = 0          # of the hits, blocks whose load failed
    # Bytes whose load or save completed, as the workers report them (a step late, for a
    # save on a saver thread): only ever growing.
    bytes_loaded: int = 0
    bytes_saved: int = 0
    evictions: int = 0             # blocks dropped to stay within its budget
    dropped_saves: int = 0         # block saves (one rank's part each) dropped: store down or busy
    bytes_stored: int = 0          # gauge: what it holds now (0: not tracked, e.g. files)
    capacity_bytes: int = 0        # gauge: its budget (0: unbounded)


@dataclass
class SchedulerStats:
    """A snapshot; the counters are totals since start-up."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float          # fraction of blocks held by requests (cached-but-free is free)
    prefix_cache_queries: int      # prompt tokens looked up
    prefix_cache_hits: int         # of those, found in the cache
    num_preemptions: int
    spec_decoding: SpecDecodingStats
    # Blocks given back from behind every layer's sliding window while their requests ran.
    num_window_freed_blocks: int = 0
    kv_tiers: list[KVTierStats] = field(default_factory=list)   # one per KV connector store
