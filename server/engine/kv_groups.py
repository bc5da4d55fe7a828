"""KV layer groups of a model whose sliding-window layers are interleaved with global ones (Gemma 2/3,
Qwen2/3 by max_window_layers): vLLM's hybrid allocator, with one pool of blocks that every group draws
from.

The layers are split into groups of equal size, each of layers with the same window (None: global):
Gemma 2's alternating layers into one global and one sliding group of half the layers each, Gemma 3's
5:1 pattern into one global group and five sliding ones. A group has its own block table per sequence
(server.engine.group_blocks), and a block of the pool holds the KV of one group's layers: the pool is
`layers_per_group` tensors, layer l's KV at tensor `layer_slot[l]` under its group's block ids. So a
block id is in one group's table at a time, and a sliding group's blocks wholly behind the window go
back to the pool (BlockManager.release_before) while the global groups keep every position: a sequence
of length n holds about (global layers x n + sliding layers x window) of KV, not all layers x n.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from server.engine.sliding_window import sequence_blocks


@dataclass(frozen=True)
class KvGroups:
    windows: tuple[int | None, ...]  # per group, its layers' window; group 0 is a global one (None)
    layer_group: tuple[int, ...]  # per layer, its group
    layer_slot: tuple[int, ...]  # per layer, its place in its group: which pool tensor holds its KV

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        return len(self.layer_group) // self.num_groups

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...] | None) -> KvGroups | None:
        """The groups of a model with both global and windowed layers; None for one with a single kind
        (every layer global, or every one windowed: server.engine.sliding_window.kv_window)."""
        if not layer_windows or None not in layer_windows or all(w is None for w in layer_windows):
            return None
        kinds: dict[int | None, list[int]] = {None: []}  # global first: group 0 covers every position
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in kinds.values()))
        windows: list[int | None] = []
        layer_group, layer_slot = [0] * len(layer_windows), [0] * len(layer_windows)
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot))

    def held_blocks(self, length: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of `length` tokens holds at once, over all its groups' tables."""
        return sum(sequence_blocks(length, block_size, w, chunk) for w in self.windows)
