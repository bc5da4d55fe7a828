"""Per-step batch metadata shared by every layer: built once per step, read by all kernels."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.launch_plan import (
    GATHER_MAX_SEG_LEN, TILE_ROWS, LoraLaunchPlan, lora_plan, lora_work, pack_int32, runs)


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
    plan: LoraLaunchPlan  # the Triton launches' work lists (kernels.launch_plan)
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
                      page_table: torch.Tensor | None = None) -> "LoraBatch":
        """A padded decode batch over persistent buffers that each step refills in place.

        token_slots: [B] int32 view, -1 for base-model and padding rows; gather: [B, 2] int32 view of
        (row, slot) per row: the gathered kernels' work list at its worst-case length, a program per
        row, those of slot -1 exiting at once. num_slots: 0 for a batch without adapters (no LoRA
        launch at all), else the slot count: any of them may occur. Nothing here depends on which.
        slot_rank_table: [L] int32, each slot's own rank, updated in place as adapters come and go.
        dora: apply the slots' DoRA scales (kernels.dora_scale), for a step in which a DoRA slot may occur.
        page_table: [L, pages per slot] int32 when the buffers are paged, updated in place (None: not paged).
        """
        rows = token_slots.shape[0]
        assert gather.shape == (rows, 2), (gather.shape, rows)
        empty = gather.new_zeros(0, 4)
        return cls(
            token_slots=token_slots,
            seg_starts=gather[:, 0],
            seg_lens=gather.new_ones(rows),
            seg_slots=token_slots,
            max_seg_len=1,
            active_slots=tuple(range(num_slots)),
            plan=LoraLaunchPlan(gather=gather, tiles={h: empty for h in TILE_ROWS}),
            runs_host=((), (), ()),  # unknown on the host: the kernels take the padded path
            padded=True,
            slot_rank_table=slot_rank_table,
            dora=dora,
            page_table=page_table,
        )


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
    ) -> "AttentionBatch":
        assert len(block_tables) == len(context_lens) == len(query_lens)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        slot_mapping: list[int] = []
        for table, start, end in zip(block_tables, context_lens, seq_lens):
            if end - start == 1:  # decode: one new token
                slot_mapping.append(table[start // block_size] * block_size + start % block_size)
                continue
            for pos in range(start, end):
                slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [x for t in block_tables for x in t + [0] * (width - len(t))]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        tables, query_start_loc, lens, contexts = pack_int32([padded, starts, seq_lens, context_lens], device)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device, non_blocking=True),
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
