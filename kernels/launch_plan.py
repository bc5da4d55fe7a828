"""Which programs each Triton launch of a step runs: built once per step on the host.

A launch over (segments x the longest segment's tiles) runs mostly empty
programs in a mixed batch (a 1792-token chunk next to 255 decodes: ~99% of
them exit at once). Instead a step lists only the work there is:

- gathered tokens: adapter tokens in short runs (decode-shaped), one program
  each, as (token, slot) pairs;
- tiles: runs longer than that, cut into tiles of TILE_ROWS rows, as
  (first token, rows, slot) triples, grouped by tile height class so that a
  3-token remainder does not pay for a 64-row tile.

Base-model (slot -1) tokens are in neither list, so no program is empty.
Every list is padded to a multiple of ALIGN int32 and packed into one host
buffer copied to the device once: one copy per step instead of one per list,
and each list starts 16-byte aligned, so Triton's pointer specialisation (and
so the set of compiled variants) never depends on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# A run of equal slots at most this long is decode-shaped: each token gathers its adapter's weights.
GATHER_MAX_SEG_LEN = 4
# Tile heights of the segmented kernels, ascending; a run is cut into tiles of the largest height and
# its remainder goes to the smallest class that holds it.
TILE_ROWS = (16, 64)
# int32 entries per 16 bytes: every packed section starts at a multiple of this.
ALIGN = 4
# Entries per gathered token (token, slot) and per tile (first token, rows, slot, unused).
GATHER_FIELDS = 2
TILE_FIELDS = 4


@dataclass(frozen=True)
class LoraLaunchPlan:
    """Device lists of one step's LoRA work; host counts give the grids without a device sync."""

    gather: torch.Tensor  # [num_gather, 2] int32 (token, slot)
    tiles: dict[int, torch.Tensor]  # tile height -> [n, 4] int32 (first token, rows, slot, 0)

    @property
    def num_gather(self) -> int:
        return self.gather.shape[0]

    def num_tiles(self, rows: int) -> int:
        return self.tiles[rows].shape[0]


def runs(token_slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Runs of equal slots: (starts, lengths, slots)."""
    starts: list[int] = []
    lens: list[int] = []
    slots: list[int] = []
    prev = None
    for i, s in enumerate(token_slots):
        if s != prev:
            starts.append(i)
            lens.append(0)
            slots.append(s)
            prev = s
        lens[-1] += 1
    return starts, lens, slots


def tile_class(rows: int) -> int:
    """The smallest tile height that holds `rows` (rows <= TILE_ROWS[-1])."""
    return next(h for h in TILE_ROWS if rows <= h)


def lora_work(starts: list[int], lens: list[int], slots: list[int], gather_max: int
              ) -> tuple[list[int], dict[int, list[int]]]:
    """Flat host lists: gathered (token, slot) pairs for runs of at most `gather_max` tokens, and tiles
    (first token, rows, slot, 0) per height class for the longer ones. Slot -1 runs give no work."""
    gather: list[int] = []
    tiles: dict[int, list[int]] = {h: [] for h in TILE_ROWS}
    top = TILE_ROWS[-1]
    for start, length, slot in zip(starts, lens, slots):
        if slot < 0:
            continue
        if length <= gather_max:
            for t in range(start, start + length):
                gather += (t, slot)
            continue
        for first in range(start, start + length, top):
            rows = min(top, start + length - first)
            tiles[tile_class(rows)] += (first, rows, slot, 0)
    return gather, tiles


# The gathered shrink splits K (in features) across programs (kernels.lora_triton_jit, SPLIT): a decode
# step's shrink is otherwise (tokens x slices) programs each streaming all of K, 3 at batch 1 on
# Llama-3-8B's qkv, and the first H100 run measured 24 us for a few KB of output. At least this many
# features per split, and at most this many splits: a split's partial costs an fp32 row per token.
MIN_SPLIT_K = 512
MAX_SHRINK_SPLITS = 8
# Whether tiled runs (the segmented kernels: prefill, and an eager step's long run of one adapter)
# split too, not only gathered tokens. Untimed on a GPU yet: the lever if their split is slower.
SPLIT_TILES = True


def shrink_splits(in_features: int, programs: int) -> int:
    """K splits of a gathered shrink of `programs` programs unsplit (tokens x slices x rank tiles).

    1 (unsplit) below 2 * MIN_SPLIT_K features. Whether a projection splits is so a property of the
    model's shape alone, and so is the set of compiled variants (server.engine.warmup compiles them
    all); how many splits is a runtime value: a power of two from 2 up to MAX_SHRINK_SPLITS and
    in_features // MIN_SPLIT_K, the largest that keeps programs x splits <= SPLIT_TARGET_PROGRAMS.
    A padded decode bucket has a fixed token count, so its split count is fixed too (graph replay).
    """
    if in_features < 2 * MIN_SPLIT_K:
        return 1
    cap = min(MAX_SHRINK_SPLITS, in_features // MIN_SPLIT_K, SPLIT_TARGET_PROGRAMS // max(1, programs))
    splits = 2
    while splits * 2 <= cap:
        splits *= 2
    return splits


def pack_int32(sections: list[list[int]], device: torch.device | str) -> list[torch.Tensor]:
    """One host buffer, one copy to `device`; returns a 1-D view per section, each 16-byte aligned."""
    offsets, total = [], 0
    for values in sections:
        offsets.append(total)
        total += -(-len(values) // ALIGN) * ALIGN
    host = torch.zeros(max(total, ALIGN), dtype=torch.int32)
    for off, values in zip(offsets, sections):
        if values:
            host[off: off + len(values)] = torch.tensor(values, dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    return [dev[off: off + len(values)] for off, values in zip(offsets, sections)]


def lora_plan(gather: list[int], tiles: dict[int, list[int]], views: list[torch.Tensor]) -> LoraLaunchPlan:
    """The plan over packed views of `gather` then each tile class in TILE_ROWS order."""
    assert len(views) == 1 + len(TILE_ROWS)
    return LoraLaunchPlan(
        gather=views[0].view(-1, GATHER_FIELDS),
        tiles={h: v.view(-1, TILE_FIELDS) for h, v in zip(TILE_ROWS, views[1:])},
    )


# Decode attention splits each context across programs (flash-decoding) when the decode sequences
# alone give fewer programs than this, about 4 per SM of a 132-SM H100: batch 1 on Llama-3-8B is
# otherwise 8 programs.
SPLIT_TARGET_PROGRAMS = 512
# Keys per split at least: a shorter split costs more in the combine pass than it saves.
MIN_SPLIT_TOKENS = 256


@dataclass(frozen=True)
class AttentionLaunchPlan:
    """One step's attention programs, for one query-tile height (it depends on the GQA group)."""

    decode: torch.Tensor  # [n, 2] int32 (sequence, 0): sequences with one query token
    prefill: torch.Tensor  # [n, 2] int32 (sequence, query tile): the other sequences' query tiles
    split_len: int  # keys per split of the decode launch, a multiple of the key tile
    num_splits: int  # splits of the longest decode context (1: not split)

    @property
    def num_decode(self) -> int:
        return self.decode.shape[0]

    @property
    def num_prefill_tiles(self) -> int:
        return self.prefill.shape[0]


def split_context(num_decode: int, num_kv_heads: int, max_len: int, key_tile: int) -> tuple[int, int]:
    """(keys per split, splits) for a decode launch; one split of the whole context when splitting
    would not pay."""
    splits = min(SPLIT_TARGET_PROGRAMS // max(1, num_decode * num_kv_heads), max_len // MIN_SPLIT_TOKENS)
    splits = max(1, splits)
    split_len = -(-(-(-max(max_len, 1) // splits)) // key_tile) * key_tile
    return split_len, -(-max(max_len, 1) // split_len)


def attention_plan(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_q: int, num_kv_heads: int,
                   key_tile: int, device: torch.device | str) -> AttentionLaunchPlan:
    decode: list[int] = []
    prefill: list[int] = []
    max_decode_len = 0
    for seq, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len == 1:
            decode += (seq, 0)
            max_decode_len = max(max_decode_len, s_len)
        else:
            for q_blk in range(-(-q_len // block_q)):
                prefill += (seq, q_blk)
    split_len, num_splits = split_context(len(decode) // 2, num_kv_heads, max_decode_len, key_tile)
    dec, pre = pack_int32([decode, prefill], device)
    return AttentionLaunchPlan(dec.view(-1, 2), pre.view(-1, 2), split_len, num_splits)
