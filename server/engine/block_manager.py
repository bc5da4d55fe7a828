"""Fixed-size KV blocks handed to sequences, with reference counts, and the index of cached blocks.

Reference counts let several sequences share a block (the prompt of a
request's n choices, or a prefix found in the cache); a block returns to the
pool when its last holder lets go. A shared block is never written: a
sequence about to write into one first takes a private copy (copy-on-write).

A full block whose K/V are computed may be indexed under its content hash
(server.engine.prefix_cache computes it). An indexed block nobody references
stays indexed, "evictable": it counts as free, and is handed out again, least
recently released first, only once no never-indexed block is left, dropping
its index entry then. So the cache only ever holds blocks nobody needs, and
never shrinks the pool that running sequences can draw from.

A sliding-window model whose every layer is windowed never reads a sequence's
KV wholly behind its window again: release_before returns those blocks to the
pool and leaves FREED in their place in the block table, so the table's
positions still map to blocks (the kernels skip keys before the window, and the
step's tensors hold block 0 there). A released indexed block is evictable like
any other: its KV stays valid, a prefix hit for a later request, until the
block is handed out again and unindexed.

Each indexed block also records the tenants that sent its content (the one
whose request computed it and every one that reused it): a hit is reported
to a tenant as cached only on blocks it had itself sent before, so the
report never says whether another tenant sent them (prefix_cache has why).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


# A block-table entry whose block went back to the pool (wholly outside every layer's window).
FREED = -1


@dataclass(frozen=True)
class KvBlockStats:
    used: int  # blocks some sequence references
    total: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # unreferenced and not indexed
        # Unreferenced indexed blocks in release order: the first is the least recently used.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}  # content hash -> block
        self.entries: dict[int, tuple[bytes, str | None]] = {}  # indexed block -> (hash, adapter version)
        self.by_version: dict[str, set[int]] = {}  # adapter version -> its indexed blocks, for retirement
        self.senders: dict[int, set[str | None]] = {}  # indexed block -> tenants that sent its content

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: never-indexed ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.entries)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable)

    def stats(self) -> KvBlockStats:
        return KvBlockStats(self.num_used_blocks, self.num_blocks)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks for a sequence holding `block_table` to cover `num_tokens` tokens."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(block_table, num_tokens) + reserve <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to `block_table` (in place) until it covers `num_tokens` tokens."""
        need = self.blocks_needed(block_table, num_tokens)
        assert need <= self.num_free_blocks, "caller must check can_grow first"
        for _ in range(need):
            block_table.append(self._allocate())

    def fork(self, block_table: list[int]) -> list[int]:
        """A new table holding the same blocks (one more reference to each)."""
        for block in block_table:
            if block != FREED:
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
        assert self.num_free_blocks, "caller must check for a free block first"
        dst = self._allocate()
        self.ref_counts[src] -= 1
        block_table[i] = dst
        return src, dst

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of `block_table` and empty it.

        Last blocks first: a released prefix is then evicted from its tail, so what stays cached
        longest is the part other prompts share most (its head).
        """
        for block in reversed(block_table):
            if block != FREED:
                self._drop(block)
        block_table.clear()

    def release_before(self, block_table: list[int], position: int) -> int:
        """Drop `block_table`'s blocks wholly before `position` (in place: FREED marks them); how many.

        Released blocks form a prefix of the table, so the scan stops at the first FREED one.
        """
        released = 0
        for i in range(min(position // self.block_size, len(block_table)) - 1, -1, -1):
            block = block_table[i]
            if block == FREED:
                break
            self._drop(block)
            block_table[i] = FREED
            released += 1
        return released

    def _drop(self, block: int) -> None:
        """One reference less to `block`; at none it is free (evictable if indexed)."""
        assert self.ref_counts[block] > 0, f"double free of block {block}"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.entries:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    # ---- the index of cached blocks ----
    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of `blocks` (cached ones) taking would draw from the free pool."""
        return sum(b != FREED and self.ref_counts[b] == 0 for b in blocks)

    def take(self, blocks: list[int]) -> None:
        """One more reference to each cached block of `blocks` (FREED entries aside): a new sequence
        reuses them."""
        for block in blocks:
            if block == FREED:
                continue
            assert block in self.entries, f"take of uncached block {block}"
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1

    def index(self, block: int, block_hash: bytes, version: str | None, tenant: str | None = None) -> bool:
        """Index a referenced, full, computed block under `block_hash`, sent by `tenant`; False if that
        content is indexed already (two sequences computed it at once: this copy stays private, and
        `tenant` counts as a sender of the indexed one, as if its request had hit it)."""
        assert self.ref_counts[block] > 0, f"index of free block {block}"
        if block in self.entries:
            return False
        if block_hash in self.cached:
            self.senders[self.cached[block_hash]].add(tenant)
            return False
        self.cached[block_hash] = block
        self.entries[block] = (block_hash, version)
        self.senders[block] = {tenant}
        if version is not None:
            self.by_version.setdefault(version, set()).add(block)
        return True

    def sent_before(self, blocks: list[int], tenant: str | None) -> int:
        """How many of the cached `blocks` (a prefix, in order) `tenant` had sent itself, counted up to
        the first it had not: a block recomputed by someone else after eviction stops the count, so
        the count never depends on what other tenants sent."""
        n = 0
        while n < len(blocks) and tenant in self.senders[blocks[n]]:
            n += 1
        return n

    def add_sender(self, blocks: list[int], tenant: str | None) -> None:
        """`tenant` sent the content of the cached `blocks` (its request reuses them)."""
        for block in blocks:
            self.senders[block].add(tenant)

    def drop_version(self, version: str) -> None:
        """Unindex every block computed with adapter `version`; the unreferenced ones are free at once,
        ahead of everything else, and the referenced ones once their holders let go."""
        for block in list(self.by_version.get(version, ())):
            self._unindex(block)
            if self.ref_counts[block] == 0:
                del self.evictable[block]
                self.free_blocks.appendleft(block)

    def drop_all(self) -> None:
        """Unindex every block (the cache was turned off or its keys changed)."""
        for block in list(self.entries):
            self._unindex(block)
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)  # the least recently released cached block
            self._unindex(block)
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def _unindex(self, block: int) -> None:
        block_hash, version = self.entries.pop(block)
        del self.cached[block_hash]
        del self.senders[block]
        if version is not None:
            mine = self.by_version[version]
            mine.discard(block)
            if not mine:
                del self.by_version[version]
