"""A sequence's block tables, one per KV layer group (server.engine.kv_groups), over one BlockManager
(KvTables), and the prefix cache over them (GroupedPrefixCache).

Every table covers the same positions: `Sequence.block_table` is group 0's (a global group) and
`Sequence.group_tables` the others', so what reads only block ids of every layer (the async step's
ahead-of-time check, the draft model's pool) reads group 0's. A model with one group (no window, or one
in every layer) has `group_tables` empty, and everything here is what the scheduler did on one table.

Growing, forking, copy-on-write, preemption and rollback act on every table alike, so a block that is
shared or private in one group is so in each. Before each step a windowed group's blocks wholly behind
its window are released (BlockManager.release_before: FREED in its table), the global groups keep all.

The prefix cache keys group 0's blocks by their hash and group g's by the hash and g, so one prefix
has one entry per group, each pointing at that group's block. A hit of k blocks needs a global group's
blocks for the whole prefix and a windowed group's for the blocks the window of position k * block_size
reads (FREED before them: a block's hash chains every token before it, whatever became of its own
group's earlier blocks); the longest k every group allows is taken.
"""
from __future__ import annotations

from collections.abc import Callable

from server.engine.block_manager import FREED, BlockManager, PrefixCache
from server.engine.sequence import Sequence


class KvTables:
    def __init__(self, blocks: BlockManager, windows: tuple[int | None, ...]) -> None:
        """windows: per group, the window behind which its blocks are released (None: kept)."""
        self.blocks = blocks
        self.windows = windows
        self.windowed = any(w is not None for w in windows)  # some group releases blocks behind a window

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s tables, group 0's first (the others' made empty on first use)."""
        extra = len(self.windows) - 1
        if len(seq.group_tables) < extra:
            seq.group_tables = [[] for _ in range(extra)]
        return [seq.block_table, *seq.group_tables]

    def blocks_needed(self, seq: Sequence, end: int) -> int:
        """Blocks `seq`'s tables need, together, to cover `end` tokens."""
        return sum(self.blocks.blocks_needed(t, end) for t in self.tables(seq))

    def can_grow(self, seq: Sequence, end: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, end) + reserve <= self.blocks.num_free_blocks

    def grow(self, seq: Sequence, end: int) -> None:
        for table in self.tables(seq):
            self.blocks.grow(table, end)

    def writes_own_block(self, seq: Sequence, end: int) -> bool:
        """Whether `seq`'s tokens up to `end` land in the last block it holds, its own in every group.
        Asked of every decoding sequence every step, so group 0 is read without building the table list."""
        start, size = seq.num_computed_tokens, self.blocks.block_size
        table, i = seq.block_table, start // size
        if end > len(table) * size or (end - 1) // size != i:
            return False
        refs = self.blocks.ref_counts
        if refs[table[i]] > 1:
            return False
        return len(self.windows) == 1 or not any(refs[t[i]] > 1 for t in self.tables(seq)[1:])

    def shared_written(self, seq: Sequence, end: int) -> list[tuple[int, int]]:
        """(group, position) of the shared blocks that `seq`'s tokens up to `end` land in: after a fork,
        the prompt's partly filled last block (usually none, else one per group)."""
        size = self.blocks.block_size
        last = min(len(seq.block_table), -(-end // size))
        return [(g, i) for g, table in enumerate(self.tables(seq))
                for i in range(seq.num_computed_tokens // size, last) if self.blocks.is_shared(table[i])]

    def copy_on_write(self, seq: Sequence, group: int, i: int) -> tuple[int, int]:
        """A private block for `seq` in place of group `group`'s shared i-th one: (source, copy). A pool
        tensor holds one layer of whichever group a block is in, so copying a block in every tensor copies
        its group's layers."""
        return self.blocks.copy_on_write(self.tables(seq)[group], i)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        tables = [self.blocks.fork(t) for t in self.tables(parent)]
        child.block_table, child.group_tables = tables[0], tables[1:]

    def free(self, seq: Sequence) -> None:
        for table in self.tables(seq):
            self.blocks.free(table)

    def release_behind_window(self, seq: Sequence) -> None:
        """Return each windowed group's blocks wholly behind the window of `seq`'s next query (position
        num_computed_tokens: it sees keys from num_computed_tokens + 1 - window on)."""
        for table, window in zip(self.tables(seq), self.windows):
            if window is not None:
                self.blocks.release_before(table, seq.num_computed_tokens + 1 - window)

    def roll_back(self, seq: Sequence) -> None:
        """Return the blocks wholly past `seq`'s computed tokens (they held only rejected drafts)."""
        keep = -(-seq.num_computed_tokens // self.blocks.block_size)
        for table in self.tables(seq):
            if len(table) > keep:
                tail = table[keep:]
                del table[keep:]
                self.blocks.free(tail)

    def take(self, seq: Sequence, hit: list[list[int]]) -> None:
        """`seq` (holding nothing) starts with the cached blocks `hit`, one table per group."""
        assert not any(self.tables(seq)), "a waiting sequence holds no KV"
        for table in hit:
            self.blocks.take(table)
        seq.block_table, seq.group_tables = hit[0], hit[1:]

    def num_unreferenced(self, hit: list[list[int]]) -> int:
        return sum(self.blocks.num_unreferenced(t) for t in hit)


class GroupedPrefixCache(PrefixCache):
    """The prefix cache of a model with several KV layer groups (module docstring)."""

    def __init__(self, blocks: BlockManager, windows: tuple[int | None, ...]) -> None:
        super().__init__(blocks)
        self.windows = windows

    def keyed_tables(self, seq: Sequence) -> list[tuple[list[int], Callable[[bytes], bytes]]]:
        return [(seq.block_table, group_key(0)), *((t, group_key(g)) for g, t in enumerate(seq.group_tables, 1))]

    def lookup(self, seq: Sequence) -> list[int] | None:
        tables = self.lookup_tables(seq)
        return None if tables is None else tables[0]

    def lookup_tables(self, seq: Sequence) -> list[list[int]] | None:
        n = self.lookup_span(seq)
        if n is None:
            return None
        hashes, size = self._hashes(seq, n), self.block_size
        found = [[self.blocks.lookup(key(h)) for h in hashes] for key in map(group_key, range(len(self.windows)))]
        run_start = [0] * len(found)  # per group: the first block after its last miss so far
        best = 0
        for k in range(1, n + 1):
            ok = True
            for g, window in enumerate(self.windows):
                if found[g][k - 1] is None:
                    run_start[g] = k
                # The first block position k * size's query reads: 0 for a global group.
                first = 0 if window is None else max(0, k * size + 1 - window) // size
                ok = ok and run_start[g] <= first
            if ok:
                best = k
        tables = []
        for g, window in enumerate(self.windows):
            first = 0 if window is None else max(0, best * size + 1 - window) // size
            tables.append([FREED] * first + found[g][first:best])
        return tables


def group_key(group: int) -> Callable[[bytes], bytes]:
    """What keys group `group`'s blocks in the index: group 0's by the hash itself (a one-group model's
    keys), the others' by the hash and the group."""
    if group == 0:
        return lambda block_hash: block_hash
    suffix = group.to_bytes(2, "big")
    return lambda block_hash: block_hash + suffix
