"""PrefixCache over a real BlockManager: what hits, what is evicted, and what a request is told it reused."""
import itertools

import pytest
from server.engine.block_manager import BlockManager, PrefixCache
from server.engine.sequence import Sequence
from tests.server.engine.sequences import request

pytestmark = pytest.mark.unit

BLOCK = 4
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks may hit (the last token always runs)


class Cache:
    """A PrefixCache and its blocks, with sequences admitted and prefilled as the scheduler and engine do."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.blocks = BlockManager(num_blocks, BLOCK)
        self.cache = PrefixCache(self.blocks)
        self.arrivals = itertools.count()

    def run(self, prompt: list[int] = PROMPT, **kw) -> Sequence:
        """Admit a request (taking its hit), compute its whole prompt and index its full blocks; it keeps
        its blocks until `done`."""
        seq = request(prompt, next(self.arrivals), **kw)
        hit = self.cache.lookup(seq)
        table = hit or []
        self.blocks.take(table)
        seq.block_table = table
        seq.num_computed_tokens = len(table) * BLOCK
        self.cache.admitted(seq, hit)
        self.blocks.grow(seq.block_table, len(seq.token_ids))
        seq.num_computed_tokens = len(seq.token_ids)
        self.cache.register(seq)
        return seq

    def done(self, *seqs: Sequence) -> None:
        for seq in seqs:
            self.blocks.free(seq.block_table)

    def hit_blocks(self, prompt: list[int] = PROMPT, **kw) -> int | None:
        """How many leading blocks a new request would reuse (None: it may not use the cache)."""
        hit = self.cache.lookup(request(prompt, next(self.arrivals), **kw))
        return None if hit is None else len(hit)


def test_an_identical_prompt_reuses_its_full_blocks_but_always_runs_the_last_token():
    c = Cache()
    first = c.run(tenant="t")
    assert first.group.num_cached_tokens == 0 and c.blocks.num_cached_blocks == 3
    again = c.run(tenant="t")
    assert again.block_table[:3] == first.block_table[:3] and again.num_computed_tokens == 13
    assert again.group.num_cached_tokens == 12
    assert c.hit_blocks(PROMPT[:12], tenant="t") == 2  # 12 tokens: the third block holds the last one
    assert c.hit_blocks(PROMPT[:4], tenant="t") is None  # nothing to reuse short of one block


def test_the_hit_stops_at_the_first_block_that_differs_and_a_block_depends_on_what_precedes_it():
    c = Cache()
    c.run(tenant="t")
    changed = list(PROMPT)
    changed[5] = 0
    assert c.hit_blocks(changed, tenant="t") == 1
    other_head = [0] + PROMPT[1:]  # blocks 1 and 2 hold the same tokens, after another block 0
    assert c.hit_blocks(other_head, tenant="t") == 0


def test_only_the_same_adapter_version_hits():
    c = Cache()
    c.run(tenant="t", version="v1")
    assert c.hit_blocks(tenant="t", version="v1") == 3
    assert c.hit_blocks(tenant="t", version="v2") == 0
    assert c.hit_blocks(tenant="t") == 0
    c.run(tenant="t")
    assert c.hit_blocks(tenant="t", version="v1") == 3 and c.hit_blocks(tenant="t") == 3


def test_an_adapter_reloaded_under_its_name_misses_the_old_versions_blocks():
    # The engine gives the reloaded adapter a new version id and retires the old one (remove_adapter).
    c = Cache()
    old = c.run(tenant="t", version="old")
    c.cache.retire("old")
    assert c.hit_blocks(tenant="t", version="new") == 0
    assert c.hit_blocks(tenant="t", version="old") is None  # a request still queued on the old id reuses nothing
    assert c.blocks.num_cached_blocks == 0
    c.done(old)
    assert c.blocks.num_evictable_blocks == 0  # nothing of the old weights stays cached
    c.run(tenant="t", version="new")
    assert c.hit_blocks(tenant="t", version="new") == 3


def test_a_retired_version_indexes_nothing_until_restored():
    c = Cache()
    c.cache.retire("v")
    c.run(tenant="t", version="v")
    assert c.blocks.num_cached_blocks == 0
    c.cache.restore("v")
    assert c.hit_blocks(tenant="t", version="v") == 0
    c.run(tenant="t", version="v")
    assert c.hit_blocks(tenant="t", version="v") == 3


def test_salts_and_tenants_partition_the_cache():
    c = Cache()
    c.run(tenant="t", salt="s")
    assert c.hit_blocks(tenant="t", salt="s") == 3
    assert c.hit_blocks(tenant="t", salt="other") == 0
    assert c.hit_blocks(tenant="t") == 0
    assert c.hit_blocks(tenant="u", salt="s") == 0  # another tenant's salt string reaches nothing
    c.run(tenant="t")
    assert c.hit_blocks(tenant="u") == 0


def test_sharing_base_blocks_across_tenants_shares_only_unsalted_base_model_blocks():
    c = Cache()
    assert c.cache.set_policy(True, share_base_across_tenants=True)
    c.run(tenant="t")
    c.run(tenant="t", version="v")
    c.run(tenant="t", salt="s")
    assert c.hit_blocks(tenant="u") == 3
    assert c.hit_blocks(tenant="u", version="v") == 0
    assert c.hit_blocks(tenant="u", salt="s") == 0


def test_cached_tokens_count_only_blocks_the_tenant_had_sent_itself():
    c = Cache()
    c.cache.set_policy(True, share_base_across_tenants=True)
    c.run(tenant="t")
    other = c.run(tenant="u")
    assert other.block_table[:3] == c.run(tenant="t").block_table[:3]  # the compute was saved ...
    assert other.group.num_cached_tokens == 0  # ... but u is not told what t sent
    assert c.run(tenant="u").group.num_cached_tokens == 12  # u sent it itself before


def test_hit_and_query_counters_count_tokens_looked_up_and_reused():
    c = Cache()
    c.run(tenant="t")
    c.run(tenant="t")
    c.run(PROMPT[:3], tenant="t")  # too short to look up: not a query
    assert c.cache.queries_tokens == 26 and c.cache.hit_tokens == 12


def test_cached_tokens_are_those_of_the_first_admission():
    c = Cache()
    c.run(tenant="t")
    seq = c.run(tenant="t")
    assert seq.group.num_cached_tokens == 12
    c.done(seq)  # preempted: its KV is dropped and it is admitted again, now with nothing to reuse
    c.blocks.drop_all()
    seq.num_computed_tokens = 0
    c.cache.admitted(seq, c.cache.lookup(seq))
    assert seq.group.num_cached_tokens == 12


def test_owed_prompt_logprobs_keep_their_positions_out_of_the_hit():
    c = Cache()
    c.run(tenant="t")
    assert c.hit_blocks(tenant="t", prompt_logprobs=1) is None


def test_unreferenced_cached_blocks_are_evicted_from_the_least_recently_released_tail():
    c = Cache(num_blocks=8)
    older = c.run(tenant="t")  # 4 blocks, 3 indexed
    newer = c.run(list(range(200, 213)), tenant="t")
    c.done(older, newer)
    assert c.blocks.num_free_blocks == 8 and c.blocks.num_evictable_blocks == 6
    table: list[int] = []
    c.blocks.grow(table, 3 * BLOCK)  # two never-indexed blocks, then the older prompt's last cached block
    assert c.hit_blocks(tenant="t") == 2 and c.hit_blocks(list(range(200, 213)), tenant="t") == 3


def test_blocks_a_running_sequence_holds_are_never_evicted():
    c = Cache(num_blocks=8)
    running = c.run(tenant="t")  # holds 4 blocks
    table: list[int] = []
    c.blocks.grow(table, 4 * BLOCK)  # every other block
    assert not c.blocks.can_grow(table, 4 * BLOCK + 1)
    assert not set(table) & set(running.block_table) and c.hit_blocks(tenant="t") == 3
    c.done(running)
    assert c.hit_blocks(tenant="t") == 3


def test_an_activated_loras_blocks_before_its_point_are_the_base_models():
    c = Cache()
    seq = request(PROMPT, 100, tenant="t", version="alora")
    seq.group.adapter_from = 8  # the invocation starts in block 2
    hit = c.cache.lookup(seq)
    c.cache.admitted(seq, hit)
    c.blocks.grow(seq.block_table, len(PROMPT))
    seq.num_computed_tokens = len(PROMPT)
    c.cache.register(seq)
    assert c.hit_blocks(tenant="t") == 2  # the base model reuses the blocks before the point
    c.cache.retire("alora")
    assert c.hit_blocks(tenant="t") == 2  # and they are not the adapter's to take away


def test_a_policy_change_drops_every_cached_block_and_turning_it_off_stops_hits():
    c = Cache()
    c.run(tenant="t")
    assert not c.cache.set_policy(True, False)  # unchanged: nothing dropped
    assert c.hit_blocks(tenant="t") == 3
    assert c.cache.set_policy(False, False)
    assert c.blocks.num_cached_blocks == 0 and c.hit_blocks(tenant="t") is None
    c.run(tenant="t")
    assert c.blocks.num_cached_blocks == 0


def test_a_windowed_model_hits_on_the_blocks_its_window_reads_alone():
    """Every layer windowed (6 tokens here): a hit of k blocks needs only the blocks the window of
    position 4k reads, the earlier ones may be handed out again meanwhile; they are FREED in the hit, and the
    request is told it reused them (the held blocks chain every token before them)."""
    from server.engine.block_manager import FREED

    c = Cache(num_blocks=8)
    c.cache = PrefixCache(c.blocks, kv_window=6)
    prompt = list(range(100, 125))  # 25 tokens: 6 full blocks may hit
    first = c.run(prompt, tenant="t")
    table = list(first.block_table)
    c.done(first)
    assert c.hit_blocks(prompt, tenant="t") == 6
    # free() released the tail first, so the head is the most recent: put blocks 0 and 1 first in line.
    for block in reversed(table[:2]):
        c.blocks.evictable.move_to_end(block, last=False)
    filler: list[int] = []
    c.blocks.grow(filler, 4 * 4)  # 4 blocks: the 2 never indexed, then blocks 0 and 1 of the prompt
    assert c.blocks.lookup(first.block_hashes[0]) is None and c.blocks.lookup(first.block_hashes[2]) is not None
    again = c.run(prompt, tenant="t")
    # Position 24 reads keys 19..24: blocks 4 and 5 are taken, 6 computed now; 0..3 FREED (0, 1 gone).
    assert again.block_table[:4] == [FREED] * 4 and again.block_table[4:6] == table[4:6]
    assert again.group.num_cached_tokens == 24
    assert c.hit_blocks(prompt, tenant="u") == 0  # another tenant's seed: nothing
    plain = PrefixCache(c.blocks)  # without the window the chain breaks at block 0
    assert plain.lookup(request(prompt, 99, tenant="t")) == []
