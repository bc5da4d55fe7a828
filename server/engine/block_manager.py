"""Fixed-size KV blocks handed to sequences, with reference counts.

Reference counts let several sequences share a block (the prompt of a
request's n choices); a block returns to the free list when its last holder
lets go. A shared block is never written: a sequence about to write into one
first takes a private copy (copy-on-write).
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks for a sequence holding `block_table` to cover `num_tokens` tokens."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(block_table, num_tokens) + reserve <= len(self.free_blocks)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to `block_table` (in place) until it covers `num_tokens` tokens."""
        need = self.blocks_needed(block_table, num_tokens)
        assert need <= len(self.free_blocks), "caller must check can_grow first"
        for _ in range(need):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            block_table.append(block)

    def fork(self, block_table: list[int]) -> list[int]:
        """A new table holding the same blocks (one more reference to each)."""
        for block in block_table:
            assert self.ref_counts[block] > 0, f"fork of free block {block}"
            self.ref_counts[block] += 1
        return list(block_table)

    def is_shared(self, block: int) -> bool:
        return self.ref_counts[block] > 1

    def copy_on_write(self, block_table: list[int], i: int) -> tuple[int, int]:
        """Give `block_table` a private block in place of its shared i-th one; returns (source, copy).

        The caller copies the source's contents into the copy before anything writes to it.
        """
        src = block_table[i]
        assert self.ref_counts[src] > 1, "copy-on-write of a block that is not shared"
        assert self.free_blocks, "caller must check for a free block first"
        dst = self.free_blocks.popleft()
        assert self.ref_counts[dst] == 0
        self.ref_counts[dst] = 1
        self.ref_counts[src] -= 1
        block_table[i] = dst
        return src, dst

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of `block_table` and empty it."""
        for block in reversed(block_table):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        block_table.clear()
