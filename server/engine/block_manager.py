"""Fixed-size KV blocks handed to sequences, with reference counts.

Reference counts let several sequences share a block (a shared prefix); a
block returns to the free list when its last holder lets go.
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

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of `block_table` and empty it."""
        for block in reversed(block_table):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        block_table.clear()
