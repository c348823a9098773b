"""Which layers share a block table: the KV cache's groups, as vLLM's hybrid allocator has them.

A model whose layers all attend alike (all to every earlier token, or all within one window)
has one group: every layer reads the request's one block table, and each layer has a cache
tensor of its own. A model that mixes full-attention and sliding-window layers (Gemma 2/3,
Qwen2 with max_window_layers) has a group per kind of layer, so that a sliding-window layer's
blocks can leave while the request runs, where a full-attention layer keeps all of its own.

Groups hold the same number of layers, `group_size` (the fewest layers of any one kind), a
kind with more layers making several groups; a group short of `group_size` layers (the last of
its kind) leaves the rest of its blocks' room unused. Layer j of every group shares cache
tensor j, and all groups draw their blocks from one pool: a block id is memory for
`group_size` layers, and whichever group holds it writes it in its own layers' tensors. So a
block costs the same whatever group takes it, and no memory is set aside for either kind.

A windowed group does not hold a whole request: its blocks behind the window leave as the
request runs (core/kv_cache_manager.py), so at any moment it holds those that the window and one
step's `reach` span (`window_blocks`). `peak_blocks` adds the groups up for one request, and
`capacity_tokens` is the longest request the cache can hold by that measure; with no reach
known, every group is counted as holding the whole request.

With a KV connector there is one group whatever the layers: a connector saves and loads a
request's KV as one block list shared by every layer (so no block leaves behind a window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KVCacheGroups:
    group_windows: tuple[int | None, ...]   # each group's sliding window; None: full attention
    layer_group: tuple[int, ...]            # each layer's group
    layer_tensor: tuple[int, ...]           # each layer's cache tensor (its index in its group)

    def __post_init__(self) -> None:
        assert len(self.layer_group) == len(self.layer_tensor)
        assert set(self.layer_group) == set(range(self.num_groups)), "every group has a layer"
        # A salted prefix hash carries the group in one byte (KVCacheManager).
        assert self.num_groups <= 256, f"{self.num_groups} KV cache groups"

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def group_size(self) -> int:
        """Layers per group: the cache tensors there are, and the layers one block serves."""
        return max(self.layer_tensor) + 1

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def tensors_of(self, layers: Sequence[int]) -> list[int]:
        """The cache tensors these layers (a pipeline stage's) use, in order."""
        return sorted({self.layer_tensor[i] for i in layers})

    def window_of_layer(self, layer: int) -> int | None:
        return self.group_windows[self.layer_group[layer]]

    def peak_blocks(self, num_tokens: int, block_size: int, reach: int | None) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, over all groups."""
        return held_blocks(-(-num_tokens // block_size), group_caps(self.group_windows, block_size, reach))

    def capacity_tokens(self, num_blocks: int, block_size: int, reach: int | None) -> int | None:
        """The longest request whose peak_blocks fit in `num_blocks`, in whole blocks; None
        where every group is windowed and their caps fit: a request of any length."""
        caps = group_caps(self.group_windows, block_size, reach)
        if None not in caps and sum(caps) <= num_blocks:
            return None
        lo, hi = 0, num_blocks   # lo fits; every group needs a block per block of sequence
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if held_blocks(mid, caps) <= num_blocks else (lo, mid - 1)
        return lo * block_size


def step_reach(max_num_batched_tokens: int, steps_in_flight: int, max_drafts: int) -> int:
    """The most positions one step can leave a request computed past its confirmed count (its
    known tokens, computed): the step's own tokens, within the budget, and those that the other
    steps in flight computed on tokens not yet known, a sampled one and its drafts each."""
    return max_num_batched_tokens + (steps_in_flight - 1) * (1 + max_drafts)


def group_caps(group_windows: Sequence[int | None], block_size: int, reach: int | None) -> list[int | None]:
    """Each group's most blocks held by one request (None: all of its blocks)."""
    return [None if w is None or reach is None else window_blocks(w, block_size, reach)
            for w in group_windows]


def held_blocks(num_sequence_blocks: int, caps: Sequence[int | None]) -> int:
    """The blocks a request spanning `num_sequence_blocks` holds over groups with these caps."""
    return sum(num_sequence_blocks if cap is None else min(num_sequence_blocks, cap) for cap in caps)


def window_blocks(window: int, block_size: int, reach: int) -> int:
    """The most blocks a windowed group holds for one request, where no step leaves the request
    more than `reach` positions past its confirmed count: the blocks that keys window - 1 before
    that count, through reach after it, can touch. KVCacheManager asserts it."""
    return -(-(window - 1 + reach) // block_size) + 1


def one_group(layer_windows: Sequence[int | None]) -> KVCacheGroups:
    """Every layer in one group (a tensor each), with the layers' window where they all share
    one, else None: whole sequences kept."""
    windows = set(layer_windows)
    n = len(layer_windows)
    return KVCacheGroups((windows.pop() if len(windows) == 1 else None,), (0,) * n, tuple(range(n)))


def kv_cache_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
    """The groups for layers with these windows (None: full attention). `hybrid=False` (a KV
    connector is configured) keeps one group."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1 or not hybrid:
        return one_group(layer_windows)
    size = min(len(layers) for layers in kinds.values())
    group_windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_tensor = [0] * len(layer_windows)
    # Full attention first: group 0 then holds every token, as the one group of other models does.
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_tensor[layer] = len(group_windows), j
            group_windows.append(window)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_tensor))
