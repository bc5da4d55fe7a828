"""The tiled (token-grouped) LoRA plan of a padded decode step: rows sorted by adapter slot, each slot's rows
cut into tiles, in a table whose size depends on the bucket alone (the graph-safe form of the segmented
kernels; vLLM punica's "sorted by LoRA" idea).

A padded decode step's gathered plan runs one program per row, each streaming its slot's A for one token:
a latency chain per token, and A read again for every row of the same slot. Sorted, a slot's rows form a
run that the segmented kernels take a tile at a time (A read once per tile, `tl.dot` on tensor cores); a
tile's row m is token row order[first + m] (the INDEXED kernels), so the rows need not be contiguous.

The table has room for the worst case of the bucket, cdiv(rows, TILE) + min(slots, rows) tiles (each slot
adds at most one partial tile): the grid, and so a captured CUDA graph, is the same whatever the step's
slots; the entries past the step's own tiles are slot -1 and their programs exit at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.host_arrays import host_tensor

# Rows per tile: tl.dot's 16-row minimum, the segmented kernels' smaller tile height (metadata.TILE_ROWS).
TILE = 16
FIELDS = 4  # per tile: (first index into order, rows, slot, 0), as the segmented kernels' tiles
_UNUSED = (0, 0, -1, 0)


def max_tiles(rows: int, num_slots: int) -> int:
    """Tiles of a bucket of `rows` rows over `num_slots` slots, at worst."""
    return -(-rows // TILE) + min(num_slots, rows)


@dataclass(frozen=True)
class SortedTiles:
    """One step's tiled plan, flat host lists ready to copy into the bucket's persistent buffers."""

    tiles: list[int]  # [max_tiles x FIELDS] (first, rows, slot, 0); unused entries (0, 0, -1, 0)
    order: list[int]  # [rows]: adapter rows sorted by slot (stable), then 0 for the unused places


def sorted_tiles(token_slots: list[int], rows: int, num_slots: int) -> SortedTiles:
    """The plan of a padded step whose first len(token_slots) rows have these slots (-1: base model) and
    whose other rows up to `rows` are padding; slots are below num_slots."""
    assert len(token_slots) <= rows, (len(token_slots), rows)
    order = sorted((r for r, s in enumerate(token_slots) if s >= 0), key=token_slots.__getitem__)
    tiles: list[int] = []
    first = 0
    while first < len(order):
        slot = token_slots[order[first]]
        end = first + 1
        while end < len(order) and end - first < TILE and token_slots[order[end]] == slot:
            end += 1
        tiles += (first, end - first, slot, 0)
        first = end
    limit = max_tiles(rows, num_slots)
    assert len(tiles) <= FIELDS * limit and max(token_slots, default=-1) < num_slots, (token_slots, num_slots)
    return SortedTiles(tiles + list(_UNUSED) * (limit - len(tiles) // FIELDS), order + [0] * (rows - len(order)))


def device_tables(plan: SortedTiles, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles [n, FIELDS], order [rows]) int32 on `device`, for LoraBatch.padded_decode's sorted_tiles (tests,
    benchmarks; the engine copies the plan into its persistent buffers instead)."""
    return (host_tensor(plan.tiles, torch.int32).view(-1, FIELDS).to(device),
            host_tensor(plan.order, torch.int32).to(device))
