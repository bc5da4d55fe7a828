"""Prefix caching: a new sequence reuses the KV of full blocks that an earlier one computed.

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
(server.engine.lora.alora).

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

import hashlib
import json
import struct
from dataclasses import dataclass

from server.engine.block_manager import FREED, BlockManager
from server.engine.lora.alora import base_blocks
from server.engine.sequence import Sequence

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
        n = limit // self.block_size
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
        table = seq.block_table
        base = base_blocks(seq.group.adapter_from, self.block_size)
        for i in range(done, full):
            if table[i] == FREED:
                continue  # released behind the window before it was offered (the cache was off then)
            # An aLoRA's blocks before its activation point are base-model KV: no version to retire.
            self.blocks.index(table[i], hashes[i], None if i < base else version, seq.tenant)

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
            # Blocks before an aLoRA's activation point are keyed as the base model's (server.engine.lora.alora).
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
        key = [version_id, None if shared else seq.tenant, shared, seq.cache_salt]
        if version_id is not None and first_active:
            key.append(first_active)
        return hashlib.sha256(json.dumps(key).encode()).digest()
