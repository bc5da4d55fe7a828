"""KV blocks and the prefix cache: fixed-size blocks handed to sequences with reference counts and the
index of cached blocks (BlockManager), and the content hashes that let a new sequence reuse them (PrefixCache).

Reference counts let several sequences share a block (the prompt of a
request's n choices, or a prefix found in the cache); a block returns to the
pool when its last holder lets go. A shared block is never written: a
sequence about to write into one first takes a private copy (copy-on-write).

A full block whose K/V are computed may be indexed under its content hash
(PrefixCache, below, computes it). An indexed block nobody references
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
report never says whether another tenant sent them (the prefix-caching notes below say why).

Prefix caching (PrefixCache): a new sequence reuses the KV of full blocks that an earlier one computed.

A full block is named by a hash chain: sha256 over (the previous block's hash,
the block's token ids, and a seed made of the adapter *version* id, the
tenant's id and the request's cache_salt). Equal names mean the same tokens
at the same positions after the same prefix under the same weights, so equal
K/V. The version id (never the adapter's name) keeps KV computed with old
weights from serving an adapter replaced under the same name; the tenant keeps
one tenant from learning, by time to first token, what another one sent (the
cache is never shared across tenants unless the operator allows it for
base-model blocks without a salt); the salt partitions further within a
tenant, and is always the tenant's own: a salted block is never shared, so
one tenant's salt string used by another reaches nothing. A
cryptographic hash because the index matches on the hash alone: Python's
`hash` can be made to collide, which would serve one prompt another's KV.

An activated LoRA's blocks wholly before its activation point hold base-model
KV, so they are keyed (and indexed) as the base model's blocks of the same
tenant and salt: the base model and every aLoRA on that prompt share them.
Its blocks from the point on are keyed on the version and the point
(aLoRA, server.engine.lora.slots).

Hashes depend only on a sequence's tokens, so each is computed once per
sequence (kept in `Sequence.block_hashes`, surviving preemption) and never per
step. A block is indexed after the step that computed its last token, so a
block still being written is never shared. Lookups stop one token short of
the end: the last token must run to give the logits of the next.
The index itself lives in the BlockManager, with the blocks. A block a
sliding-window sequence released behind its window stays indexed while its KV
is intact (a hit for a later request with that prefix) and leaves the index
when it is handed out again, so no hit ever reads KV overwritten since.

What a request is told (`num_cached_tokens`, OpenAI's `cached_tokens`) is not
the hit but the part of it the request's tenant had itself sent before: under
shared base blocks a hit on blocks only another tenant sent still saves the
compute, but reporting it would say exactly what the other tenant sent. Not
"the blocks this tenant wrote" either: a tenant sending a prompt twice would
learn from the second answer whether its first had been a hit. Time to first
token still tells, roughly: that channel is what the operator's option accepts.
"""
from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from server.engine.lora.slots import base_blocks
from server.engine.sequence import Sequence


def _same(block_hash: bytes) -> bytes:
    return block_hash


# A block-table entry whose block went back to the pool (wholly outside every layer's window).
FREED = -1


@dataclass(frozen=True)
class KvBlockStats:
    used: int  # blocks some sequence references
    total: int
    lent: int = 0  # blocks' memory adapter pages hold (--unified-memory: server.engine.unified_memory)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, pack: bool = False) -> None:
        """pack (--unified-memory): a block a sequence lets go is handed out again first, so the KV stays in
        the groups of blocks it already touches (the lowest) and whole groups stay whole for adapter pages
        (`lend`, which takes the highest); without it, blocks go round in release order."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pack = pack
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # unreferenced and not indexed
        # Unreferenced indexed blocks in release order: the first is the least recently used.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}  # content hash -> block
        self.entries: dict[int, tuple[bytes, str | None]] = {}  # indexed block -> (hash, adapter version)
        self.by_version: dict[str, set[int]] = {}  # adapter version -> its indexed blocks, for retirement
        self.senders: dict[int, set[str | None]] = {}  # indexed block -> tenants that sent its content
        self.num_lent_blocks = 0  # held by adapter pages (lend), not by sequences

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: never-indexed ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references, or lent to adapter pages."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.entries)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable)

    def stats(self) -> KvBlockStats:
        return KvBlockStats(self.num_used_blocks - self.num_lent_blocks, self.num_blocks, self.num_lent_blocks)

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

    def lendable(self, size: int, taking: frozenset[int] = frozenset()) -> int:
        """Aligned groups of `size` blocks (blocks g*size .. g*size+size-1) that `lend` could take now: none
        of their blocks held by a sequence or lent, nor in `taking` (cached blocks a sequence is about to take)."""
        refs = self.ref_counts
        return sum(1 for g in range(self.num_blocks // size)
                   if not any(refs[b] or b in taking for b in range(g * size, g * size + size)))

    def lend(self, size: int) -> int:
        """One aligned group of `size` blocks for an adapter page (--unified-memory: the page is the same
        memory, server.engine.unified_buffer), out of circulation until `repay`; its index. The group with
        the fewest cached blocks, the last among equals: never-indexed memory goes before any prefix, and
        pages gather at the top of the pool, away from the KV (`pack`)."""
        refs, best, fewest = self.ref_counts, None, size + 1
        for g in reversed(range(self.num_blocks // size)):
            group = range(g * size, g * size + size)
            if not any(refs[b] for b in group) and (cached := sum(b in self.entries for b in group)) < fewest:
                best, fewest = g, cached
                if not cached:
                    break
        assert best is not None, "caller must check lendable first"
        for block in range(best * size, best * size + size):
            if block in self.entries:
                del self.evictable[block]
                self._unindex(block)
            else:
                self.free_blocks.remove(block)
            self.ref_counts[block] = 1
        self.num_lent_blocks += size
        return best

    def repay(self, blocks: list[int]) -> None:
        """Lent blocks back to the pool (never indexed: free at once), handed out last: a whole group."""
        self.num_lent_blocks -= len(blocks)
        for block in blocks:
            assert self.ref_counts[block] == 1, f"repay of block {block} not lent"
            self.ref_counts[block] = 0
            self.free_blocks.append(block)

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
            elif self.pack:
                self.free_blocks.appendleft(block)
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


ROOT = bytes(32)  # the "previous block" of a sequence's first block


@dataclass(frozen=True)
class PrefixCacheStats:
    """Tokens counted at each admission, readmissions after preemption included; hit rate =
    hit_tokens / queried_tokens."""

    enabled: bool
    queried_tokens: int  # tokens of the sequences looked up
    hit_tokens: int  # of those, tokens whose KV came from the cache
    cached_blocks: int  # KV blocks indexed in the cache (in use or not)
    cached_free_blocks: int  # of those, blocks no request holds: evictable, counted as free


class PrefixCache:
    def __init__(self, blocks: BlockManager, kv_window: int | None = None) -> None:
        """kv_window: ModelConfig.kv_window; with one, a hit needs only the blocks its first uncached
        token's window reads (the ones before it may be gone)."""
        self.blocks = blocks
        self.kv_window = kv_window
        self.block_size = blocks.block_size
        self.pack = struct.Struct(f"<{blocks.block_size}q").pack
        self.enabled = True
        # Base-model blocks shared by every tenant: an operator's choice (the timing side channel).
        self.share_base_across_tenants = False
        # Deleted or replaced adapter versions: their blocks were dropped, and their requests still
        # running index nothing more. Ids are never reused, so this only grows with deletions.
        self.retired: set[str] = set()
        self.queries_tokens = 0  # tokens of the sequences looked up (at admission)
        self.hit_tokens = 0  # of those, tokens whose KV came from the cache

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.enabled, self.queries_tokens, self.hit_tokens, self.blocks.num_cached_blocks,
                                self.blocks.num_evictable_blocks)

    def set_policy(self, enabled: bool, share_base_across_tenants: bool) -> bool:
        """True if the keys changed: every indexed block is dropped, and the caller must clear every
        live sequence's `block_hashes` (they were computed under the old seeds)."""
        if (enabled, share_base_across_tenants) == (self.enabled, self.share_base_across_tenants):
            return False
        self.enabled, self.share_base_across_tenants = enabled, share_base_across_tenants
        self.blocks.drop_all()
        return True

    def lookup(self, seq: Sequence) -> list[int] | None:
        """The cached blocks that start `seq` (not yet referenced: BlockManager.take does that), or
        None when `seq` may not use the cache."""
        n = self.lookup_span(seq)
        if n is None:
            return None
        hashes = self._hashes(seq, n)
        if self.kv_window is not None:
            return self._windowed_hit(hashes)
        hit: list[int] = []
        for i in range(n):
            block = self.blocks.lookup(hashes[i])
            if block is None:
                break
            hit.append(block)
        return hit

    def lookup_tables(self, seq: Sequence) -> list[list[int]] | None:
        """lookup() as one block table per KV layer group (server.engine.group_blocks): one here."""
        hit = self.lookup(seq)
        return None if hit is None else [hit]

    def lookup_span(self, seq: Sequence) -> int | None:
        """How many of `seq`'s leading full blocks a hit may cover; None when `seq` may not use the cache."""
        if not self.enabled or seq.version_id in self.retired:
            return None
        limit = len(seq.token_ids) - 1  # at least the last token runs: its logits give the next token
        owed = seq.group.prompt_logprobs
        if owed is not None and len(owed) < seq.num_prompt_tokens:
            # Prompt logprobs still owed need the logits of the positions before them: from entry
            # len(owed) on, computed at positions len(owed) - 1 on, which must run.
            limit = min(limit, len(owed) - 1)
        if limit < self.block_size:
            return None
        return limit // self.block_size

    def _windowed_hit(self, hashes: list[bytes]) -> list[int]:
        """The longest k blocks whose last ones, those the window of position k * block_size reads,
        are all cached: FREED for the blocks before them (a block's hash chains every token before
        it, so its KV is that of the same prefix whatever became of the earlier blocks)."""
        size, best, run_start = self.block_size, (0, 0), 0
        found: list[int | None] = []
        for i, h in enumerate(hashes):
            found.append(self.blocks.lookup(h))
            if found[-1] is None:
                run_start = i + 1
                continue
            first = max(0, (i + 1) * size + 1 - self.kv_window) // size  # first block the next token reads
            if first >= run_start:
                best = (first, i + 1)
        first, end = best
        return [FREED] * first + found[first:end]

    def admitted(self, seq: Sequence, hit: list[int] | None) -> None:
        """`seq` starts with the `hit` blocks (now in its block table): count the query and the hit, and
        report to the request the part its tenant had sent before."""
        if hit is not None:
            self.queries_tokens += len(seq.token_ids)
            self.hit_tokens += len(hit) * self.block_size
        hit = hit or []
        seq.num_registered_blocks = len(hit)
        held = [b for b in hit if b != FREED]
        known = self.blocks.sent_before(held, seq.tenant)
        self.blocks.add_sender(held, seq.tenant)
        if known:  # its first held block chains the FREED ones before it: the tenant sent those too
            known += len(hit) - len(held)
        if seq.group.num_cached_tokens is None:
            seq.group.num_cached_tokens = known * self.block_size

    def register(self, seq: Sequence) -> None:
        """Index the blocks that `seq`'s last step filled (after its num_computed_tokens grew)."""
        full = seq.num_computed_tokens // self.block_size
        done = seq.num_registered_blocks
        if full <= done or not self.enabled:
            return
        seq.num_registered_blocks = full
        version = seq.version_id
        if version in self.retired:
            return
        hashes = self._hashes(seq, full)
        base = base_blocks(seq.group.adapter_from, self.block_size)
        for table, key in self.keyed_tables(seq):
            for i in range(done, full):
                if table[i] == FREED:
                    continue  # released behind the window before it was offered (the cache was off then)
                # An aLoRA's blocks before its activation point are base-model KV: no version to retire.
                self.blocks.index(table[i], key(hashes[i]), None if i < base else version, seq.tenant)

    def keyed_tables(self, seq: Sequence) -> list[tuple[list[int], Callable[[bytes], bytes]]]:
        """`seq`'s block tables, each with what turns a block's hash into its key in the index: one table
        keyed by the hash itself here (a KV layer group's own keys: server.engine.group_blocks)."""
        return [(seq.block_table, _same)]

    def retire(self, version: str) -> None:
        """`version` was deleted or replaced: nothing may reuse its KV; its free blocks go back first."""
        self.retired.add(version)
        self.blocks.drop_version(version)

    def restore(self, version: str) -> None:
        """`version` is served again (the same id is the same weights)."""
        self.retired.discard(version)

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """`seq.block_hashes`, extended to at least its first n full blocks (each computed once)."""
        hashes = seq.block_hashes
        if len(hashes) < n:
            first_active = seq.group.adapter_from
            # Blocks before an aLoRA's activation point are keyed as the base model's (server.engine.lora.slots).
            base = base_blocks(first_active, self.block_size)
            own = self._seed(seq.version_id, seq, first_active)
            base_seed = own if seq.version_id is None or not base else self._seed(None, seq, 0)
            tokens, size, pack = seq.token_ids, self.block_size, self.pack
            parent = hashes[-1] if hashes else ROOT
            for i in range(len(hashes), n):
                seed = base_seed if i < base else own
                parent = hashlib.sha256(parent + seed + pack(*tokens[i * size : (i + 1) * size])).digest()
                hashes.append(parent)
        return hashes

    def _seed(self, version_id: str | None, seq: Sequence, first_active: int) -> bytes:
        """What besides the tokens decides a block's KV, and who may reuse it: the adapter version
        (None: the base model) and, for an aLoRA, where it starts applying."""
        # A salt is the tenant's own: another tenant sending the same string must reach nothing.
        shared = version_id is None and self.share_base_across_tenants and seq.cache_salt is None
        key = (version_id, None if shared else seq.tenant, shared, seq.cache_salt)
        if version_id is not None and first_active:
            key += (first_active,)
        return _seed_digest(key)


@functools.lru_cache(maxsize=4096)
def _seed_digest(key: tuple) -> bytes:
    """A seed's digest, made once per key: each block a sequence fills is hashed under it."""
    return hashlib.sha256(json.dumps(key).encode()).digest()
