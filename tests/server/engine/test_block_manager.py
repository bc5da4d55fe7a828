"""BlockManager: KV blocks handed out and taken back, shared by reference count, and cached when indexed."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.block_manager import BlockManager, KvBlockStats

pytestmark = pytest.mark.unit


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_grow_allocates_whole_blocks_for_the_tokens_and_free_returns_them():
    bm = BlockManager(8, 4)
    table: list[int] = []
    assert bm.blocks_needed(table, 9) == 3
    bm.grow(table, 9)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    bm.grow(table, 12)  # the third block still has room
    assert len(table) == 3
    bm.grow(table, 13)
    assert len(table) == 4 and bm.num_used_blocks == 4
    bm.free(table)
    assert table == [] and bm.num_used_blocks == 0 and bm.num_free_blocks == 8


def test_growing_never_shrinks_a_table():
    bm = BlockManager(4, 4)
    table: list[int] = []
    bm.grow(table, 10)
    before = list(table)
    assert bm.blocks_needed(table, 2) == 0
    bm.grow(table, 2)
    assert table == before and bm.num_used_blocks == 3


def test_exhaustion_is_reported_by_can_grow_counting_the_reserve():
    bm = BlockManager(4, 4)
    a: list[int] = []
    bm.grow(a, 12)  # 3 of 4 blocks
    assert bm.can_grow([], 4) and not bm.can_grow([], 5)
    assert not bm.can_grow([], 4, reserve=1)
    assert bm.can_grow(a, 16) and not bm.can_grow(a, 17)
    b: list[int] = []
    bm.grow(b, 4)
    assert bm.num_free_blocks == 0 and not bm.can_grow([], 1) and bm.can_grow(a, 12)


def test_fork_shares_every_block_until_both_holders_free():
    bm = BlockManager(6, 4)
    parent: list[int] = []
    bm.grow(parent, 8)
    child = bm.fork(parent)
    assert child == parent and child is not parent
    assert all(bm.is_shared(b) for b in parent)
    assert bm.num_used_blocks == 2  # shared blocks count once
    bm.free(parent)
    assert bm.num_used_blocks == 2 and not any(bm.is_shared(b) for b in child)
    bm.free(child)
    assert bm.num_used_blocks == 0


def test_copy_on_write_gives_the_writer_a_private_block_and_leaves_the_other_holder_alone():
    bm = BlockManager(6, 4)
    parent: list[int] = []
    bm.grow(parent, 6)  # a full block and a partly filled one
    child = bm.fork(parent)
    src, dst = bm.copy_on_write(child, 1)
    assert src == parent[1] and dst not in parent
    assert child == [parent[0], dst]
    assert not bm.is_shared(parent[1]) and not bm.is_shared(dst) and bm.is_shared(parent[0])
    assert bm.num_used_blocks == 3
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6


def test_a_freed_block_is_reused_only_after_the_never_used_ones():
    bm = BlockManager(4, 4)
    a: list[int] = []
    bm.grow(a, 4)
    freed = a[0]
    bm.free(a)
    b: list[int] = []
    bm.grow(b, 12)
    assert freed not in b
    bm.grow(b, 16)
    assert b[-1] == freed


def test_an_indexed_block_outlives_its_holder_and_is_reused_last():
    bm = BlockManager(4, 4)
    a: list[int] = []
    bm.grow(a, 4)
    cached = a[0]
    assert bm.index(cached, _hash(1), None)
    bm.free(a)
    assert bm.lookup(_hash(1)) == cached and bm.num_evictable_blocks == 1
    assert bm.num_free_blocks == 4  # an unreferenced cached block counts as free
    b: list[int] = []
    bm.grow(b, 12)  # the three never-indexed blocks first
    assert cached not in b and bm.lookup(_hash(1)) == cached
    bm.grow(b, 16)  # then the cached one, its index entry dropped
    assert b[-1] == cached and bm.lookup(_hash(1)) is None and bm.num_cached_blocks == 0


def test_taking_a_cached_block_references_it_so_it_is_not_handed_out():
    bm = BlockManager(3, 4)
    a: list[int] = []
    bm.grow(a, 4)
    bm.index(a[0], _hash(1), None)
    bm.free(a)
    reuse = [bm.lookup(_hash(1))]
    assert bm.num_unreferenced(reuse) == 1
    bm.take(reuse)
    assert bm.num_unreferenced(reuse) == 0 and bm.num_free_blocks == 2
    other: list[int] = []
    bm.grow(other, 8)
    assert reuse[0] not in other and not bm.can_grow(other, 9)


def test_indexing_content_already_indexed_keeps_the_second_copy_private():
    bm = BlockManager(4, 4)
    a: list[int] = []
    b: list[int] = []
    bm.grow(a, 4)
    bm.grow(b, 4)
    assert bm.index(a[0], _hash(7), None)
    assert not bm.index(b[0], _hash(7), None)
    assert bm.lookup(_hash(7)) == a[0] and bm.num_cached_blocks == 1
    bm.free(b)
    assert bm.num_evictable_blocks == 0  # the private copy went straight back to the pool


def test_drop_version_frees_its_unreferenced_blocks_first_and_the_held_ones_at_release():
    bm = BlockManager(6, 4)
    held: list[int] = []
    idle: list[int] = []
    base: list[int] = []
    bm.grow(held, 4)
    bm.grow(idle, 4)
    bm.grow(base, 4)
    bm.index(held[0], _hash(1), "v1")
    bm.index(idle[0], _hash(2), "v1")
    bm.index(base[0], _hash(3), None)
    idle_block, held_block = idle[0], held[0]
    bm.free(idle)
    bm.free(base)
    bm.drop_version("v1")
    assert bm.lookup(_hash(1)) is None and bm.lookup(_hash(2)) is None and bm.lookup(_hash(3)) is not None
    assert bm.num_cached_blocks == 1 and bm.num_evictable_blocks == 1
    fresh: list[int] = []
    bm.grow(fresh, 4)
    assert fresh == [idle_block]  # ahead of blocks never used
    bm.free(held)
    assert bm.num_evictable_blocks == 1 and held_block not in bm.evictable


def test_drop_all_empties_the_index_and_keeps_references():
    bm = BlockManager(4, 4)
    a: list[int] = []
    b: list[int] = []
    bm.grow(a, 4)
    bm.grow(b, 4)
    bm.index(a[0], _hash(1), "v")
    bm.index(b[0], _hash(2), None)
    bm.free(b)
    bm.drop_all()
    assert bm.num_cached_blocks == 0 and bm.num_evictable_blocks == 0
    assert bm.lookup(_hash(1)) is None and bm.lookup(_hash(2)) is None
    assert bm.num_used_blocks == 1 and bm.num_free_blocks == 3
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_evictable_blocks == 0


# ---- invariants under random use ----

_op = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 3), st.integers(1, 12)),
    st.tuples(st.just("fork"), st.integers(0, 3)),
    st.tuples(st.just("free"), st.integers(0, 3)),
    st.tuples(st.just("index"), st.integers(0, 3), st.integers(0, 3), st.integers(0, 5)),
    st.tuples(st.just("cow"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("reuse"), st.integers(0, 5)),
)


def _apply(bm: BlockManager, tables: list[list[int]], op: tuple) -> None:
    kind, t = op[0], tables[op[1] % len(tables)] if op[0] != "reuse" else None
    if kind == "grow":
        want = len(t) * bm.block_size + op[2]
        if bm.can_grow(t, want):
            bm.grow(t, want)
    elif kind == "fork" and t:
        tables.append(bm.fork(t))
    elif kind == "free":
        bm.free(t)
    elif kind == "index" and t:
        bm.index(t[op[2] % len(t)], _hash(op[3]), "v" if op[3] % 2 else None)
    elif kind == "cow" and t and bm.is_shared(t[op[2] % len(t)]) and bm.num_free_blocks:
        bm.copy_on_write(t, op[2] % len(t))
    elif kind == "reuse":
        block = bm.lookup(_hash(op[1]))
        if block is not None:
            bm.take([block])
            tables.append([block])


def _check(bm: BlockManager, tables: list[list[int]]) -> None:
    held = Counter(b for t in tables for b in t)
    assert all(bm.ref_counts[b] == held[b] for b in range(bm.num_blocks))
    unreferenced = {b for b in range(bm.num_blocks) if not held[b]}
    free, evictable = set(bm.free_blocks), set(bm.evictable)
    assert len(free) == len(bm.free_blocks) and not free & evictable
    assert free | evictable == unreferenced
    assert bm.num_used_blocks == len(held) and bm.num_free_blocks == bm.num_blocks - len(held)
    assert evictable <= set(bm.entries) and not free & set(bm.entries)
    assert {block: h for h, block in bm.cached.items()} == {b: h for b, (h, _) in bm.entries.items()}
    for t in tables:
        assert len(set(t)) == len(t)  # a table never holds one block twice


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=40))
def test_random_use_keeps_counts_pool_and_index_consistent(ops):
    bm = BlockManager(10, 4)
    tables: list[list[int]] = [[], [], [], []]
    for op in ops:
        _apply(bm, tables, op)
        _check(bm, tables)
    for t in tables:
        bm.free(t)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10
    assert bm.num_evictable_blocks == bm.num_cached_blocks


def test_release_before_frees_whole_blocks_behind_a_position_and_leaves_placeholders():
    """Blocks wholly before the position go back (indexed ones evictable, still hits), FREED in their
    place; the table keeps its length, so growing, forking and freeing it go on as before."""
    from server.engine.block_manager import FREED

    bm = BlockManager(8, 4)
    table: list[int] = []
    bm.grow(table, 20)  # 5 blocks
    first, second = table[0], table[1]
    bm.index(first, _hash(0), None)
    assert bm.release_before(table, 3) == 0  # block 0 still holds position 3
    assert bm.release_before(table, 8) == 2
    assert table[:2] == [FREED, FREED] and bm.num_used_blocks == 3
    assert bm.lookup(_hash(0)) == first and first in bm.evictable and second in bm.free_blocks
    assert bm.release_before(table, 9) == 0  # a prefix is released once
    assert bm.release_before(table, -5) == 0
    bm.grow(table, 24)
    assert len(table) == 6 and bm.num_used_blocks == 4
    child = bm.fork(table)
    assert child[:2] == [FREED, FREED] and all(bm.ref_counts[b] == 2 for b in table[2:])
    bm.release_before(child, 12)
    assert child[:3] == [FREED] * 3 and bm.ref_counts[table[2]] == 1
    bm.free(child)
    bm.free(table)
    assert bm.num_used_blocks == 0 and sorted(bm.ref_counts) == [0] * 8


def test_lending_to_adapter_pages_takes_aligned_groups_nobody_holds_never_indexed_ones_first():
    """--unified-memory's pages (server.engine.unified_memory): a page is an aligned group of blocks (the same
    memory, server.engine.unified_buffer), none held by a sequence; groups without cached blocks go first,
    then the one with the fewest, whose cached blocks leave the index; the highest among equals. Lent blocks
    count apart from sequences' and come back free, handed out last; packed, a sequence's freed block first."""
    bm = BlockManager(8, 4, pack=True)
    a, b = [], []
    bm.grow(a, 8)  # blocks 0, 1
    bm.grow(b, 8)  # blocks 2, 3
    for i, block in enumerate(a):
        bm.index(block, _hash(i), None)
    bm.free(a)  # 0 and 1 cached, nobody holds them; b holds 2 and 3
    assert bm.lendable(2) == 3 and bm.lendable(2, frozenset({0})) == 2 and bm.lendable(4) == 1
    assert [bm.lend(2), bm.lend(2)] == [3, 2]  # blocks 4..7: free, never indexed
    assert bm.lendable(2) == 1 and bm.num_cached_blocks == 2
    assert bm.lend(2) == 0 and bm.num_cached_blocks == 0 and bm.lookup(_hash(0)) is None
    assert bm.lendable(2) == 0  # group 1 is b's
    assert bm.stats() == KvBlockStats(used=2, total=8, lent=6) and bm.num_free_blocks == 0
    bm.repay([0, 1, 4, 5])
    assert bm.stats() == KvBlockStats(used=2, total=8, lent=2) and bm.num_free_blocks == 4
    bm.free(b)
    assert bm.lendable(4) == 1 and bm.lendable(2) == 3
    assert list(bm.free_blocks) == [2, 3, 0, 1, 4, 5]  # b's blocks first (released tail first), repaid last
