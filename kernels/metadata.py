"""Per-step batch metadata shared by every layer: built once per step on the host, read by all kernels;
with it, which programs each Triton launch of the step runs (the launch plans).

Launch plans: a launch over (segments x the longest segment's tiles) runs mostly empty
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

from array import array
from dataclasses import dataclass, field

import torch

from kernels.host_arrays import host_array, host_tensor
from kernels.padded_tables import PaddedTables
from kernels.sorted_tiles import FIELDS as TILE_FIELDS  # per tile: (first token, rows, slot, unused)
from kernels.sorted_tiles import TILE, device_tables, max_tiles, sorted_tiles

# A run of equal slots at most this long is decode-shaped: each token gathers its adapter's weights.
GATHER_MAX_SEG_LEN = 4
# Tile heights of the segmented kernels, ascending; a run is cut into tiles of the largest height and
# its remainder goes to the smallest class that holds it.
TILE_ROWS = (16, 64)
# int32 entries per 16 bytes: every packed section starts at a multiple of this.
ALIGN = 4
# Entries per gathered token (token, slot); per tile, TILE_FIELDS (kernels.sorted_tiles, the one definition).
GATHER_FIELDS = 2
_ZEROS = host_array((0,) * ALIGN, torch.int32)  # a section's padding


@dataclass(frozen=True)
class LoraLaunchPlan:
    """Device lists of one step's LoRA work; host counts give the grids without a device sync."""

    gather: torch.Tensor  # [num_gather, 2] int32 (token, slot)
    tiles: dict[int, torch.Tensor]  # tile height -> [n, 4] int32 (first token, rows, slot, 0)
    # [rows] int32 or None: a tile's row m is token row order[first + m] (a padded decode step's tiled
    # plan, kernels.sorted_tiles; its unused tiles have slot -1); None: token row first + m.
    order: torch.Tensor | None = None

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
# Which LoRA form a padded decode step (server.engine.decode_graphs) runs: "gathered" (a program per row,
# kernels.lora_triton_jit's _bgmv_*) or "tiled" (rows sorted by slot into tiles of the segmented kernels,
# kernels.sorted_tiles). Gathered until a GPU times them (docs/engine.md, "Kernels", says what to compare).
PADDED_LORA_FORM = "gathered"


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


def pack_int32(sections: list[list[int] | array], device: torch.device | str) -> list[torch.Tensor]:
    """One host buffer, one copy to `device`; returns a 1-D view per section, each 16-byte aligned."""
    host = host_array((), torch.int32)
    offsets = []
    for values in sections:
        offsets.append(len(host))
        host.extend(values)
        host.extend(_ZEROS[: -len(values) % ALIGN])
    if not host:
        host.extend(_ZEROS)
    dev = host_tensor(host, torch.int32).to(device, non_blocking=True)
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


@dataclass(frozen=True)
class LoraBatch:
    """Which adapter slot each token of the step uses.

    Tokens of one request are contiguous, so equal slots form runs
    ("segments"): the segmented kernels load one adapter's weights per run.
    """

    token_slots: torch.Tensor  # [T] int32, slot index per token, -1 = base model only
    seg_starts: torch.Tensor  # [G] int32, first token of each run of equal slots
    seg_lens: torch.Tensor  # [G] int32
    seg_slots: torch.Tensor  # [G] int32, slot of each run (may be -1)
    max_seg_len: int
    active_slots: tuple[int, ...]  # distinct slots >= 0 present, ascending (host copy)
    plan: LoraLaunchPlan  # the Triton launches' work lists (lora_plan)
    runs_host: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (starts, lens, slots) on the host
    rank_bound: int | None = None  # highest rank among active slots; slot rows past it are zero
    # A padded decode batch (padded_decode): one token per row, every launch sized by the row count
    # alone; active_slots is then every slot that may occur (a bound, not the data) and rank_bound None.
    padded: bool = False
    # [L] int32 on the device: each slot's own rank (0 = free), for kernels that stop there; None: every
    # slot taken at full rank.
    slot_rank_table: torch.Tensor | None = None
    # Whether a slot that may occur holds a DoRA adapter: the model then scales each row's projections by
    # its slot's DoRA scales (kernels.dora_scale); a step without one skips that.
    dora: bool = False
    # [L, pages per slot] int32 on the device: the adapter memory is paged by rank (server.engine.lora.slots):
    # the buffers hold pages of rank rows ([S, P, page rows, in] for A, [P, n_i, page rows] for B) and slot
    # s's rank row r is row r % page_rows of page page_table[s, r // page_rows]. Entries past an adapter's
    # own pages name the zero page. None: one page per slot, slot s's rows at index s (the buffers are slots).
    page_table: torch.Tensor | None = None
    # Paged, on a CPU: gathers of earlier steps that are still exact (server.engine.lora.page_gathers), or
    # None. kernels.lora_pages.SlotWeights reads and fills it.
    page_gathers: dict | None = field(default=None, compare=False, repr=False)
    # Per-step derived data an implementation computes once and every layer reuses.
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    def slot_width(self, buffer_rows: int) -> int:
        """A slot's rank rows seen through the page table: buffer_rows (the buffers' rank dimension) times
        its pages (one when not paged)."""
        return buffer_rows if self.page_table is None else buffer_rows * self.page_table.shape[1]

    def effective_rank(self, buffer_rank: int) -> int:
        """Rank columns worth computing: rows past every active adapter's rank are zero."""
        return buffer_rank if self.rank_bound is None else min(buffer_rank, self.rank_bound)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def any_lora(self) -> bool:
        return bool(self.active_slots)

    def plan_for(self, form: str) -> LoraLaunchPlan:
        """The step's plan ("mixed"), or every adapter token in one form ("gathered" or "segmented").

        The single-form plans exist for tests and benchmarks of each kernel; built on first use.
        """
        if form == "mixed":
            return self.plan
        assert form in ("gathered", "segmented"), form
        key = ("plan", form)
        if key not in self.scratch:
            gather_max = max(self.max_seg_len, 1) if form == "gathered" else 0
            gather, tiles = lora_work(*self.runs_host, gather_max)
            views = pack_int32([gather, *(tiles[h] for h in TILE_ROWS)], self.token_slots.device)
            self.scratch[key] = lora_plan(gather, tiles, views)
        return self.scratch[key]

    @classmethod
    def build(
        cls, token_slots: list[int], device: torch.device | str = "cpu", slot_ranks: list[int] | None = None,
        slot_rank_table: torch.Tensor | None = None, slot_dora: list[bool] | None = None,
        page_table: torch.Tensor | None = None, page_gathers: dict | None = None,
    ) -> "LoraBatch":
        """`slot_ranks[s]` is the rank of the adapter in slot s (bounds the work; optional);
        slot_rank_table the same on the device (optional); slot_dora[s]: slot s holds a DoRA adapter;
        page_table: where each slot's rank rows live when the buffers are paged (None: not paged)."""
        starts, lens, slots = runs(token_slots)
        gather, tiles = lora_work(starts, lens, slots, GATHER_MAX_SEG_LEN)
        views = pack_int32([token_slots, starts, lens, slots, gather, *(tiles[h] for h in TILE_ROWS)], device)
        active = tuple(sorted({s for s in slots if s >= 0}))
        return cls(
            token_slots=views[0],
            seg_starts=views[1],
            seg_lens=views[2],
            seg_slots=views[3],
            max_seg_len=max(lens, default=0),
            active_slots=active,
            plan=lora_plan(gather, tiles, views[4:]),
            runs_host=(tuple(starts), tuple(lens), tuple(slots)),
            rank_bound=max((slot_ranks[s] for s in active), default=0) if slot_ranks is not None else None,
            slot_rank_table=slot_rank_table,
            dora=slot_dora is not None and any(slot_dora[s] for s in active),
            page_table=page_table,
            page_gathers=page_gathers,
        )

    @classmethod
    def padded_decode(cls, token_slots: torch.Tensor, gather: torch.Tensor, num_slots: int,
                      slot_rank_table: torch.Tensor | None = None, dora: bool = False,
                      page_table: torch.Tensor | None = None,
                      tiled_plan: tuple[torch.Tensor, torch.Tensor] | None = None) -> "LoraBatch":
        """A padded decode batch over persistent buffers that each step refills in place.

        token_slots: [B] int32 view, -1 for base-model and padding rows; gather: [B, 2] int32 view of
        (row, slot) per row: the gathered kernels' work list at its worst-case length, a program per
        row, those of slot -1 exiting at once. num_slots: 0 for a batch without adapters (no LoRA
        launch at all), else the slot count: any of them may occur. Nothing here depends on which.
        slot_rank_table: [L] int32, each slot's own rank, updated in place as adapters come and go.
        dora: apply the slots' DoRA scales (kernels.dora_scale), for a step in which a DoRA slot may occur.
        page_table: [L, pages per slot] int32 when the buffers are paged, updated in place (None: not paged).
        tiled_plan: (tiles [sorted_tiles.max_tiles(B, num_slots), 4], order [B]) int32 views: the tiled
        plan (kernels.sorted_tiles) instead of the gathered one, refilled in place like `gather`.
        """
        rows = token_slots.shape[0]
        assert gather.shape == (rows, 2), (gather.shape, rows)
        empty = gather.new_zeros(0, 4)
        plan = LoraLaunchPlan(gather=gather, tiles={h: empty for h in TILE_ROWS})
        if tiled_plan is not None:
            tiles, order = tiled_plan
            assert TILE in TILE_ROWS and tiles.shape == (max_tiles(rows, num_slots), TILE_FIELDS), (tiles.shape, rows)
            assert order.shape == (rows,), (order.shape, rows)
            plan = LoraLaunchPlan(gather=gather.new_zeros(0, 2), tiles={h: tiles if h == TILE else empty
                                                                       for h in TILE_ROWS}, order=order)
        return cls(
            token_slots=token_slots,
            seg_starts=gather[:, 0],
            seg_lens=gather.new_ones(rows),
            seg_slots=token_slots,
            max_seg_len=1,
            active_slots=tuple(range(num_slots)),
            plan=plan,
            runs_host=((), (), ()),  # unknown on the host: the kernels take the padded path
            padded=True,
            slot_rank_table=slot_rank_table,
            dora=dora,
            page_table=page_table,
        )

    @classmethod
    def padded_tiled(cls, token_slots: list[int], rows: int, num_slots: int, device: torch.device | str,
                     page_table: torch.Tensor | None = None, slot_rank_table: torch.Tensor | None = None
                     ) -> "LoraBatch":
        """A padded decode batch of `rows` rows (those past token_slots: padding) on the tiled plan
        (kernels.sorted_tiles), in tensors of its own: for warm-up, tests and benchmarks (the engine refills
        persistent buffers instead). page_table, slot_rank_table: as padded_decode's."""
        padded = host_tensor([*token_slots, *[-1] * (rows - len(token_slots))], torch.int32).to(device)
        gather = torch.stack([torch.arange(rows, dtype=torch.int32, device=device), padded], 1)
        return cls.padded_decode(padded, gather, num_slots, slot_rank_table, page_table=page_table,
                                 tiled_plan=device_tables(sorted_tiles(token_slots, rows, num_slots), device))


@dataclass(frozen=True)
class AttentionBatch:
    """Where each sequence of the step lives in the paged KV pool.

    Sequence b contributes query tokens query_start_loc[b]:query_start_loc[b+1];
    its first context_lens[b] tokens are already cached (a continued prefix or
    earlier decode steps) and the new tokens sit at positions
    context_lens[b] .. seq_lens[b]-1.
    """

    slot_mapping: torch.Tensor  # [T] int64, flat pool slot (block * block_size + offset) of each new token
    # [B, max_blocks] int32, padded with 0; a negative entry is a block released behind every layer's
    # window (server.engine.block_manager.FREED), which no kernel reads.
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    context_lens: torch.Tensor  # [B] int32, tokens cached before this step
    max_query_len: int
    max_seq_len: int
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # A padded decode batch (padded_decode): the host values are bounds, not the data, so every launch
    # is sized the same whatever the step; the device tensors hold the data.
    padded: bool = False
    # Per-step derived data an implementation computes once and every layer reuses.
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        kept_tables: PaddedTables | None = None,
    ) -> "AttentionBatch":
        """kept_tables: the padded tables of the previous step, updated where the rows changed (the engine's
        steps), instead of padded afresh."""
        assert len(block_tables) == len(context_lens) == len(query_lens)
        bs = block_size
        if query_lens.count(1) == len(query_lens):  # decode only (the usual step): one new token each
            seq_lens = [c + 1 for c in context_lens]
            slot_mapping = [t[c // bs] * bs + c % bs for t, c in zip(block_tables, context_lens)]
            starts = list(range(len(query_lens) + 1))
        else:
            seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
            slot_mapping: list[int] = []
            for table, start, end in zip(block_tables, context_lens, seq_lens):
                if end - start == 1:  # decode: one new token
                    slot_mapping.append(table[start // bs] * bs + start % bs)
                    continue
                for pos in range(start, end):
                    slot_mapping.append(table[pos // bs] * bs + pos % bs)
            starts = [0]
            for q in query_lens:
                starts.append(starts[-1] + q)
        padded, width = (kept_tables or PaddedTables()).update(block_tables)  # [B, width], each row padded with 0
        tables, query_start_loc, lens, contexts = pack_int32([padded, starts, seq_lens, context_lens], device)
        return cls(
            slot_mapping=host_tensor(slot_mapping).to(device, non_blocking=True),
            block_tables=tables.view(len(block_tables), width),
            query_start_loc=query_start_loc,
            seq_lens=lens,
            context_lens=contexts,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )

    @classmethod
    def padded_decode(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, context_lens: torch.Tensor, max_seq_len: int) -> "AttentionBatch":
        """B decode rows (one query token each) over persistent buffers that each step refills in place.

        Shape: slot_mapping [B] int64 (-1: a padding row, which writes no KV); block_tables [B, W] int32
        at the pool's full width; query_start_loc [B+1] int32 = 0..B; seq_lens, context_lens [B] int32
        (a padding row: 1 and 0). Every sequence is taken to be max_seq_len long for the launch plans
        (the most splits any step can need; the splits past a sequence's end exit at once).
        """
        rows = slot_mapping.shape[0]
        assert block_tables.shape[0] == rows and query_start_loc.shape == (rows + 1,), (block_tables.shape, rows)
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            context_lens=context_lens,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_host=(1,) * rows,
            seq_lens_host=(max_seq_len,) * rows,
            padded=True,
        )
