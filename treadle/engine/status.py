"""A snapshot of what the engine is doing, for the console's dashboard (`/v1/engine/status`).

Built on the engine thread, between steps, so every count in it belongs to one moment.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from treadle.engine.core import EngineCore
from treadle.request import Request

# A grid of more blocks than this is drawn in groups (a cell stands for several blocks).
MAX_GRID_CELLS = 4096
# Grid cell values, ordered so that a group of blocks shows its most telling one (max): a block
# held by running request i is i; held otherwise (a KV load or send) is HELD.
HELD, CACHED, FREE = -1, -2, -3


def engine_status(core: EngineCore) -> dict[str, Any]:
    scheduler = core.scheduler
    running = list(scheduler.running)
    waiting = [*scheduler.loaded, *scheduler.waiting]
    stats = core.get_stats()
    spec = stats.spec_decoding
    return {
        "paused": core.paused,
        "asleep": sorted(core.asleep),
        "speculative": (dataclasses.asdict(core.config.speculative)
                        if core.config.speculative is not None else None),
        "running": [_request(r) for r in running],
        "waiting": [_request(r) for r in waiting]
        + [{"id": r.client_id, "state": "compiling grammar"} for r in core.grammars.requests()],
        "kv_cache": _grid(core, running),
        "stats": {
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_cache_hit_rate": (stats.prefix_cache_hits / stats.prefix_cache_queries
                                      if stats.prefix_cache_queries else None),
            "num_preemptions": stats.num_preemptions,
            "spec_draft_tokens": spec.num_draft_tokens,
            "spec_accepted_tokens": spec.num_accepted_tokens,
            "spec_acceptance_rate": spec.acceptance_rate if spec.num_draft_tokens else None,
        },
    }


def _request(r: Request) -> dict[str, Any]:
    return {"id": r.client_id, "state": r.status.name.lower(),
            "prompt_tokens": r.num_prompt_tokens, "computed_tokens": r.num_computed_tokens,
            "output_tokens": r.num_output_tokens, "max_tokens": r.max_tokens}


def _grid(core: EngineCore, running: list[Request]) -> dict[str, Any]:
    """Every usable block as free, cached (free, its prefix kept), or held: by a running request
    (its index in "running"; a block shared by several shows the first) or by a KV transfer."""
    kv = core.scheduler.kv_cache
    blocks = kv.pool.blocks[1:]   # block 0 is the null block that pads tables
    owner = {}
    for i, r in enumerate(running):
        for group in kv.get_block_ids(r.request_id):
            for block_id in group:
                owner.setdefault(block_id, i)
    cells = [owner.get(b.block_id, HELD if b.ref_cnt else
                       CACHED if b.block_hash is not None else FREE) for b in blocks]
    per_cell = -(-len(cells) // MAX_GRID_CELLS)
    if per_cell > 1:
        cells = [max(cells[i:i + per_cell]) for i in range(0, len(cells), per_cell)]
    return {"num_blocks": len(blocks), "block_size": kv.block_size, "blocks_per_cell": per_cell,
            "cells": cells}
