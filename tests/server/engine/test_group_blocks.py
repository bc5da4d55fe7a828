"""The prefix cache over KV layer groups (server.engine.group_blocks.GroupedPrefixCache): a hit of k blocks
needs the global group's blocks for the whole prefix and each windowed group's for the blocks the window
of position k * block_size reads, FREED before them; each group's blocks under its own keys."""
from __future__ import annotations

import pytest

from server.engine.block_manager import FREED, BlockManager
from server.engine.group_blocks import GroupedPrefixCache, group_key
from tests.server.engine.sequences import request

pytestmark = pytest.mark.unit

BLOCK, WINDOW = 16, 20


def indexed(present: list[set[int]]):
    """A pool and a cache where group g has the blocks of positions present[g] of a 120-token prompt
    indexed (then released: evictable), and that prompt plus 7 tokens to look up."""
    blocks = BlockManager(64, BLOCK)
    cache = GroupedPrefixCache(blocks, (None, WINDOW))
    prompt = list(range(1, 121))
    writer = request(prompt, 0)
    hashes = cache._hashes(writer, 7)
    ids = {}
    for g, positions in enumerate(present):
        for i in sorted(positions):
            table: list[int] = []
            blocks.grow(table, BLOCK)
            blocks.index(table[0], group_key(g)(hashes[i]), None)
            ids[g, i] = table[0]
            blocks.free(table)
    return cache, request(prompt + [500] * 7, 1), ids


def test_a_windowed_group_needs_only_the_blocks_its_window_reads():
    cache, seq, ids = indexed([set(range(7)), {5, 6}])
    global_table, window_table = cache.lookup_tables(seq)
    assert global_table == [ids[0, i] for i in range(7)]
    # Position 112's window reads 93..112: blocks 5 and 6.
    assert window_table == [FREED] * 5 + [ids[1, 5], ids[1, 6]]


def test_the_longest_prefix_every_group_allows():
    # The windowed group lacks block 4: k = 6 would read blocks 4 and 5; k = 7 reads 5 and 6.
    cache, seq, ids = indexed([set(range(7)), {0, 1, 2, 3, 5, 6}])
    assert [len(t) for t in cache.lookup_tables(seq)] == [7, 7]
    # Without block 6 either, the longest k whose window's blocks are there is 4 (it reads blocks 2 and 3).
    cache, seq, ids = indexed([set(range(7)), {0, 1, 2, 3, 5}])
    global_table, window_table = cache.lookup_tables(seq)
    assert len(global_table) == 4 and window_table == [FREED] * 2 + [ids[1, 2], ids[1, 3]]
    # The global group lacks block 3: at most 3 blocks, whatever the windowed group has.
    cache, seq, ids = indexed([{0, 1, 2, 4, 5, 6}, set(range(7))])
    assert [len(t) for t in cache.lookup_tables(seq)] == [3, 3]


def test_one_groups_blocks_are_not_anothers_hit():
    cache, seq, _ = indexed([set(), set(range(7))])
    assert cache.lookup_tables(seq) == [[], []]
    assert cache.lookup(seq) == []
