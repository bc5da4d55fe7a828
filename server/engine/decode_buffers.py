"""Persistent device buffers for everything a decode step reads, refilled in place by one copy per step.

A CUDA graph replays the kernels it captured with the arguments they had: the
same pointers, grids and scalars. So a decode step that is to be replayed
reads its inputs from buffers that never move, sized for the largest batch
bucket, and every step writes its rows into a host staging buffer (pinned on
CUDA) that goes to the device in one copy. Rows past the step's own
(padding, up to the bucket) are a base-model token at position 0 whose KV
write is skipped (slot -1) and whose attention reads one cached key (block 0
of the pool, zero or finite), so nothing they compute is NaN or reaches a real
row.

Bucket sizes follow vLLM's capture sizes in spirit: 1, 2, 4, 8, then each
power of two from 16 and the midpoint to the next (24, 48, 96, ...), up to
and including the largest batch the scheduler can form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.host_arrays import host_tensor
from kernels.sorted_tiles import FIELDS, max_tiles, sorted_tiles

# Bytes each section starts on: Triton's pointer specialisation (16-byte alignment) never depends on
# the layout, so a padded step compiles no variant the warm-up has not.
ALIGN_BYTES = 16


def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """Padded decode batch sizes, ascending, the last one max_rows: 1, 2, 4, 8, 16, 24, 32, 48, 64, ..."""
    assert max_rows >= 1
    sizes = [1, 2, 4, 8]
    p = 16
    while p < max_rows:
        sizes += [p, p + p // 2]
        p *= 2
    return tuple(sorted({s for s in sizes if s < max_rows} | {max_rows}))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `rows` (rows <= buckets[-1])."""
    return next(b for b in buckets if b >= rows)


@dataclass(frozen=True)
class _Section:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


class DecodeBuffers:
    """The host staging buffer and its device twin, with a view per input of the padded decode step.

    Views (device; `host` has the same on the host), max_rows = the largest bucket B:
    input_ids, positions [B] int64; slot_mapping [B] int64; seq_lens, context_lens [B] int32;
    token_slots [B] int32; gather [B, 2] int32 (row, slot): the LoRA work list; block_tables [B, W]
    int32, W = the blocks of one max_model_len sequence. Constants, never refilled: query_start_loc
    [B+1] int32 = 0..B and logits_rows [B] int64 = 0..B-1. With tiled_slots (the tiled LoRA plan over
    that many slots, kernels.sorted_tiles): lora_tiles [max_tiles(B, tiled_slots), 4] and lora_order [B]
    int32, a step of bucket b writing the first max_tiles(b, tiled_slots) tiles and b order entries.
    """

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device, tiled_slots: int | None = None) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.device = device
        self.tiled_slots = tiled_slots
        b = max_rows
        tiled = [] if tiled_slots is None else [("lora_tiles", torch.int32, (max_tiles(b, tiled_slots), FIELDS)),
                                                ("lora_order", torch.int32, (b,))]
        spec = [("input_ids", torch.int64, (b,)), ("positions", torch.int64, (b,)),
                ("slot_mapping", torch.int64, (b,)), ("seq_lens", torch.int32, (b,)),
                ("context_lens", torch.int32, (b,)), ("token_slots", torch.int32, (b,)),
                ("gather", torch.int32, (b, 2)), *tiled,
                ("block_tables", torch.int32, (b, max_blocks))]  # last: a step copies only its rows
        sections, offset = [], 0
        for name, dtype, shape in spec:
            sec = _Section(name, dtype, shape, offset)
            sections.append(sec)
            offset += -(-sec.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.sections = {s.name: s for s in sections}
        pin = device.type == "cuda"
        self.host_bytes = torch.zeros(offset, dtype=torch.uint8, pin_memory=pin)
        self.device_bytes = torch.zeros(offset, dtype=torch.uint8, device=device)
        # Marks the last copy out of the pinned staging buffer, which the next fill must not overtake.
        self.copied = torch.cuda.Event() if pin else None
        self.host = {s.name: self._view(self.host_bytes, s) for s in sections}
        self.dev = {s.name: self._view(self.device_bytes, s) for s in sections}
        self.host["gather"][:, 0] = torch.arange(b, dtype=torch.int32)  # constant: program i takes row i
        self._pad(0, b)
        self._sort(b, [])
        self.copy_in(b)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(b, dtype=torch.int64, device=device)

    @staticmethod
    def _view(buf: torch.Tensor, s: _Section) -> torch.Tensor:
        return buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)

    def fill(self, rows: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
             block_tables: list[list[int]], token_slots: list[int]) -> None:
        """Write one step's `n` real rows, then padding up to `rows`, into the staging buffer.

        Block table columns past a sequence's own blocks keep earlier steps' entries: valid block ids,
        never read past the sequence's length, so only the step's widest table is written.
        """
        n = len(input_ids)
        assert n <= rows <= self.max_rows, (n, rows, self.max_rows)
        if self.copied is not None:
            self.copied.synchronize()  # done long ago when the last step sampled (its logits synchronized)
        self._pad(n, rows)
        self._sort(rows, token_slots)
        if not n:
            return
        h = self.host
        lens = [p + 1 for p in positions]
        for name, values in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping)):
            h[name][:n] = torch.tensor(values, dtype=torch.int64)
        for name, values in (("seq_lens", lens), ("context_lens", positions), ("token_slots", token_slots)):
            h[name][:n] = torch.tensor(values, dtype=torch.int32)
        h["gather"][:n, 1] = h["token_slots"][:n]
        width = max(len(t) for t in block_tables)
        assert width <= self.max_blocks, (width, self.max_blocks)
        flat = [x for t in block_tables for x in t + [0] * (width - len(t))]
        h["block_tables"][:n, :width] = torch.tensor(flat, dtype=torch.int32).view(n, width)

    def _sort(self, rows: int, token_slots: list[int]) -> None:
        """The tiled LoRA plan of a step of `rows` rows (kernels.sorted_tiles), when there is one."""
        if self.tiled_slots is None:
            return
        plan = sorted_tiles(token_slots, rows, self.tiled_slots)
        tiles = host_tensor(plan.tiles, torch.int32)
        self.host["lora_tiles"][: tiles.shape[0] // FIELDS] = tiles.view(-1, FIELDS)
        self.host["lora_order"][:rows] = host_tensor(plan.order, torch.int32)

    def _pad(self, first: int, rows: int) -> None:
        """Rows first..rows-1 become padding: token 0 at position 0, no KV write, no adapter, one key."""
        h = self.host
        for name in ("input_ids", "positions", "context_lens"):
            h[name][first:rows] = 0
        h["slot_mapping"][first:rows] = -1
        h["seq_lens"][first:rows] = 1
        h["token_slots"][first:rows] = -1
        h["gather"][first:rows, 1] = -1
        h["block_tables"][first:rows, 0] = 0

    def copy_in(self, rows: int) -> None:
        """One host-to-device copy of everything a step of `rows` rows reads (non-blocking from pinned
        memory: the next fill waits for it)."""
        tables = self.sections["block_tables"]
        end = tables.offset + rows * self.max_blocks * 4
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def rows(self, name: str, rows: int) -> torch.Tensor:
        """The device view of input `name` for a bucket of `rows` rows."""
        return self.dev[name][:rows]

    def tiled_plan(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device views of the tiled LoRA plan (lora_tiles, lora_order) for a bucket of `rows` rows."""
        return self.dev["lora_tiles"][: max_tiles(rows, self.tiled_slots)], self.dev["lora_order"][:rows]
