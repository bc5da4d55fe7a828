"""Per-step batch metadata shared by every layer: built once per step, read by all kernels."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    rank_bound: int | None = None  # highest rank among active slots; slot rows past it are zero
    # Per-step derived data an implementation computes once and every layer reuses.
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    def effective_rank(self, buffer_rank: int) -> int:
        """Rank columns worth computing: rows past every active adapter's rank are zero."""
        return buffer_rank if self.rank_bound is None else min(buffer_rank, self.rank_bound)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def any_lora(self) -> bool:
        return bool(self.active_slots)

    @classmethod
    def build(
        cls, token_slots: list[int], device: torch.device | str = "cpu", slot_ranks: list[int] | None = None
    ) -> "LoraBatch":
        """`slot_ranks[s]` is the rank of the adapter in slot s (bounds the work; optional)."""
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

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        active = tuple(sorted({s for s in slots if s >= 0}))
        return cls(
            token_slots=as_tensor(token_slots),
            seg_starts=as_tensor(starts),
            seg_lens=as_tensor(lens),
            seg_slots=as_tensor(slots),
            max_seg_len=max(lens, default=0),
            active_slots=active,
            rank_bound=max((slot_ranks[s] for s in active), default=0) if slot_ranks is not None else None,
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
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    context_lens: torch.Tensor  # [B] int32, tokens cached before this step
    max_query_len: int
    max_seq_len: int
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
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
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)

        def as_tensor(values, dtype=torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            slot_mapping=as_tensor(slot_mapping, torch.int64),
            block_tables=as_tensor(padded).reshape(len(block_tables), width),
            query_start_loc=as_tensor(starts),
            seq_lens=as_tensor(seq_lens),
            context_lens=as_tensor(context_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )
