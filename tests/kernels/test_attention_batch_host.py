"""AttentionBatch.build's vectorised host metadata equals the per-token definition: each new token's
pool slot from its sequence's table, tables padded with 0, prefix sums of the query lengths."""
import random

import pytest
import torch

from kernels.metadata import AttentionBatch

pytestmark = pytest.mark.unit


def _reference(tables, contexts, queries, bs):
    slots = [t[p // bs] * bs + p % bs for t, c, q in zip(tables, contexts, queries) for p in range(c, c + q)]
    width = max((len(t) for t in tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    return slots, padded


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_per_token_definition(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    tables, contexts, queries = [], [], []
    for _ in range(rng.randint(1, 40)):
        q = 1 if seed % 2 else rng.randint(1, 40)  # odd seeds: decode-only steps
        c = rng.randint(0, 60)
        n = -(-(c + q) // bs) + rng.randint(0, 2)
        tables.append([rng.choice([-1, *range(500)]) if i < c // bs else rng.randrange(500) for i in range(n)])
        contexts.append(c)
        queries.append(q)
    batch = AttentionBatch.build(tables, contexts, queries, bs)
    slots, padded = _reference(tables, contexts, queries, bs)
    assert batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.tolist() == slots
    assert batch.block_tables.dtype == torch.int32 and batch.block_tables.tolist() == padded
    starts = [0]
    for q in queries:
        starts.append(starts[-1] + q)
    assert batch.query_start_loc.tolist() == starts
    assert batch.seq_lens.tolist() == [c + q for c, q in zip(contexts, queries)]
    assert batch.context_lens.tolist() == contexts
    assert batch.seq_lens_host == tuple(c + q for c, q in zip(contexts, queries))
    assert all(type(x) is int for x in batch.seq_lens_host)
    assert batch.max_seq_len == max(batch.seq_lens_host) and batch.query_lens_host == tuple(queries)


def test_build_empty_batch():
    batch = AttentionBatch.build([], [], [], 16)
    assert batch.slot_mapping.numel() == 0 and tuple(batch.block_tables.shape) == (0, 1)
    assert batch.query_start_loc.tolist() == [0] and batch.max_seq_len == 0
