"""Block tables kept from step to step (kernels.padded_tables) equal tables padded afresh, whatever
changed between two steps: blocks appended, an entry replaced in place (a copy-on-write, a block released
behind a window), rows joining, leaving or reordered."""
import random

import pytest
import torch

from kernels.metadata import AttentionBatch
from kernels.padded_tables import PaddedTables

pytestmark = pytest.mark.unit


def _change(rng: random.Random, tables: list[list[int]]) -> None:
    op = rng.random()
    if op < 0.3:
        rng.choice(tables).append(rng.randrange(100))
    elif op < 0.45:
        t = rng.choice(tables)
        t[rng.randrange(len(t))] = rng.choice((-1, rng.randrange(100)))
    elif op < 0.6:
        tables.append([rng.randrange(100) for _ in range(rng.randint(1, 7))])
    elif op < 0.7 and len(tables) > 1:
        tables.pop(rng.randrange(len(tables)))
    elif op < 0.75:
        rng.shuffle(tables)


@pytest.mark.parametrize("seed", range(4))
def test_kept_tables_equal_fresh_ones(seed):
    rng = random.Random(seed)
    kept = PaddedTables()
    tables = [[rng.randrange(100) for _ in range(rng.randint(1, 5))] for _ in range(12)]
    for _ in range(200):
        _change(rng, tables)
        contexts = [len(t) * 4 - 1 for t in tables]  # one decode token, in each row's last block
        queries = [1] * len(tables)
        fresh = AttentionBatch.build(tables, contexts, queries, 4)
        reused = AttentionBatch.build(tables, contexts, queries, 4, kept_tables=kept)
        assert torch.equal(fresh.block_tables, reused.block_tables)
        assert torch.equal(fresh.slot_mapping, reused.slot_mapping)


def test_an_earlier_steps_tensor_is_not_rewritten():
    """The kept array is copied into each step's tensor: a step still reading its tables keeps them."""
    kept = PaddedTables()
    tables = [[1, 2], [3]]
    first = AttentionBatch.build(tables, [7, 3], [1, 1], 4, kept_tables=kept).block_tables.clone()
    earlier = AttentionBatch.build(tables, [7, 3], [1, 1], 4, kept_tables=kept)
    tables[1].append(9)
    AttentionBatch.build(tables, [7, 4], [1, 1], 4, kept_tables=kept)
    assert torch.equal(earlier.block_tables, first)
