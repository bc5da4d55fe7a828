"""Scheduler: token budget and chunked prefill, fair steps, seats, adapter slots, preemption, fair share, forks, aborts.

Real parts throughout: a BlockManager, LoraSlots over a one-layer slot buffer, a HostTier holding tiny
adapters, and a `Steps` driver that plays the engine's part (advance what a batch computed, index full
blocks, append a token when a prompt is in, fork, finish) with tokens that depend only on their
position, so a recomputed sequence must come out the same.
"""
import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.format import LoraAdapter, LoraWeights
from adapters.host_tier import HostTier
from server.engine.block_manager import FREED, BlockManager
from server.engine.lora.slots import LoraGroupBuffers, LoraSlots
from server.engine import scheduler as scheduler_module
from server.engine.scheduler import PLAIN, ScheduledBatch, Scheduler, SchedulerLimits, StepCost
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.step_latency import LatencyCap
from tests.server.engine.sequences import request

pytestmark = pytest.mark.unit

BLOCK = 4
WIDTH, RANK = 4, 2  # the one adapted projection (layer 0's o_proj) of the slot buffers


def _adapter() -> LoraAdapter:
    weights = {(0, "o_proj"): LoraWeights(torch.ones(RANK, WIDTH), torch.ones(WIDTH, RANK), 1.0)}
    return LoraAdapter(RANK, ("o_proj",), False, weights, 2 * RANK * WIDTH * 4, {})


def _token(seq: Sequence) -> int:
    return (7 * len(seq.token_ids) + seq.index) % 97


class Steps:
    """A Scheduler and the engine's side of each step, checking the batch's limits as it goes."""

    def __init__(self, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, max_loras: int = 2,
                 cap: int | None = None, versions: tuple[str, ...] = (), step_cost: StepCost = PLAIN,
                 kv_window: int | None = None, latency_cap: LatencyCap | None = None) -> None:
        self.config = SchedulerLimits(max_num_seqs, budget, cap, step_cost=step_cost, kv_window=kv_window,
                                      latency_cap=latency_cap)
        self.blocks = BlockManager(num_blocks, BLOCK)
        layers = [{"o": LoraGroupBuffers.allocate(WIDTH, (WIDTH,), max_loras, RANK, torch.float32, "cpu")}]
        self.slots = LoraSlots(layers, max_loras)
        self.host = HostTier(None, None)
        for version in versions:
            self.host.add(version, _adapter())
        self.scheduler = Scheduler(self.config, self.blocks, self.slots, self.host)
        self.arrivals = itertools.count()
        self.admitted: list[Sequence] = []  # in order of first admission
        self.finished: list[Sequence] = []

    def add(self, prompt_len: int = 8, **kw) -> Sequence:
        arrival = next(self.arrivals)
        seq = request([(arrival + i) % 89 for i in range(prompt_len)], arrival, **kw)
        self.scheduler.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        decoding = any(seq.num_pending_tokens == 1 for seq in self.scheduler.running)
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is not None and self.scheduler.latency is not None:
            cap = self.scheduler.latency.cap(cap)
        batch = self.scheduler.schedule()
        self._check(batch)
        if decoding and cap is not None:
            self._check_prompt_work(batch, cap)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq not in self.admitted:
                self.admitted.append(seq)
            seq.num_computed_tokens += n
            self.scheduler.prefix_cache.register(seq)
            if seq.num_pending_tokens:
                continue  # a prompt chunk
            choices = [seq, *self.scheduler.fork(seq)] if seq.group.needs_fork else [seq]
            for choice in choices:
                choice.token_ids.append(_token(choice))
                self.scheduler.waiting.charge_output(choice)
                if choice.num_output_tokens == choice.params.max_tokens:
                    self.scheduler.finish(choice)
                    self.finished.append(choice)
        return batch

    def abort(self, seq: Sequence) -> None:
        for choice in seq.group.seqs:
            if not choice.finished:
                self.scheduler.finish(choice)

    def drain(self, max_steps: int = 500) -> list[ScheduledBatch]:
        batches = []
        while self.scheduler.has_unfinished():
            assert len(batches) < max_steps, "the scheduler stopped making progress"
            batches.append(self.step())
        return batches

    def _check(self, batch: ScheduledBatch) -> None:
        sched = self.scheduler
        assert sum(batch.num_tokens) <= self.config.max_num_batched_tokens
        assert len(sched.running) <= self.config.max_num_seqs
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        versions = {s.version_id for s in batch.seqs if s.version_id is not None}
        assert len(versions) <= self.slots.max_loras
        for seq, n, slot in zip(batch.seqs, batch.num_tokens, batch.lora_slots):
            assert seq.status is SequenceStatus.RUNNING and 0 < n <= seq.num_pending_tokens
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
            # Every block the step's queries read is held: released ones lie wholly behind the window.
            window = self.config.kv_window
            first = 0 if window is None else max(0, seq.num_computed_tokens + 1 - window) // BLOCK
            assert FREED not in seq.block_table[first:]
            assert (slot == -1) == (seq.version_id is None)
            assert slot == -1 or self.slots.slot_of[seq.version_id] == slot
        held = Counter(b for s in sched.running for b in s.block_table)
        assert all(self.blocks.ref_counts[b] == held[b] for b in range(self.blocks.num_blocks))
        for seq in batch.preempted:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq in sched.waiting

    def _check_prompt_work(self, batch: ScheduledBatch, cap: float) -> None:
        """While some sequence decodes, the step's prompt chunks cost at most the cap, passed only by the
        one token a tenant's first chunk may take past its share."""
        cost = self.config.step_cost
        work, first_tokens = 0.0, {}
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_pending_tokens > 1:
                work += cost.chunk(seq, seq.num_computed_tokens, n)
                first_tokens.setdefault(seq.tenant, cost.chunk(seq, seq.num_computed_tokens, 1))
        assert work <= cap + sum(first_tokens.values()) + 1e-6

    def expected_tokens(self, seq: Sequence) -> list[int]:
        """What `seq` generates had it never been preempted (tokens depend on their position alone)."""
        tokens = list(seq.prompt_token_ids)
        while len(tokens) < seq.num_prompt_tokens + seq.params.max_tokens:
            tokens.append((7 * len(tokens) + seq.index) % 97)
        return tokens


def test_admission_fills_the_token_budget_and_prefills_what_does_not_fit_in_chunks():
    s = Steps(budget=16)
    a, b, c = s.add(10), s.add(10), s.add(10)
    first = s.step()
    assert first.seqs == [a, b] and first.num_tokens == [10, 6]
    second = s.step()
    assert second.seqs == [a, b, c] and second.num_tokens == [1, 4, 10]
    assert b.num_output_tokens == 1 and c.num_output_tokens == 1


def test_prompts_are_capped_while_a_sequence_decodes():
    s = Steps(budget=32, cap=4)
    a = s.add(6)
    assert s.step().num_tokens == [6]  # nothing decodes yet: the whole budget
    b = s.add(20)
    batches = [s.step() for _ in range(5)]
    assert [x.num_tokens for x in batches] == [[1, 4], [1, 4], [1, 4], [8], [1]]
    assert a.finished and b.num_output_tokens == 2


def test_no_more_sequences_run_than_max_num_seqs():
    s = Steps(max_num_seqs=2)
    a, b, c = s.add(), s.add(), s.add()
    s.step()
    assert s.scheduler.running == [a, b] and c in s.scheduler.waiting
    while not a.finished:
        s.step()
    s.step()
    assert c in s.scheduler.running


def test_a_batch_holds_at_most_max_loras_adapters_and_base_requests_pass_a_blocked_one():
    s = Steps(max_loras=2, versions=("v1", "v2", "v3"))
    r1, r2, r3 = s.add(version="v1"), s.add(version="v2"), s.add(version="v3")
    base = s.add()
    first = s.step()
    assert first.seqs == [r1, r2, base] and r3 in s.scheduler.waiting
    s.drain()
    assert r3.finished and s.admitted.index(r3) == 3
    assert not s.slots.users and not s.host.pins


def test_requests_for_one_adapter_share_its_slot():
    s = Steps(max_loras=1, versions=("v1", "v2"))
    same = [s.add(version="v1") for _ in range(3)]
    other = s.add(version="v2")
    first = s.step()
    assert first.seqs == same and len(set(first.lora_slots)) == 1 and other in s.scheduler.waiting
    s.drain()
    assert other.finished


def test_a_short_pool_preempts_the_newest_which_comes_back_and_finishes_unchanged():
    s = Steps(num_blocks=6, budget=64)
    old, new = s.add(8, max_tokens=12), s.add(8, max_tokens=12)
    preempted = [seq for batch in s.drain() for seq in batch.preempted]
    assert preempted and set(preempted) == {new}
    assert s.scheduler.num_preemptions == len(preempted)
    assert s.finished[0] is old
    assert new.token_ids == s.expected_tokens(new) and old.token_ids == s.expected_tokens(old)
    assert s.blocks.num_used_blocks == 0


def test_a_preempted_sequence_is_recomputed_from_its_tokens():
    s = Steps(num_blocks=6, budget=64)
    s.add(8, max_tokens=12)
    new = s.add(8, max_tokens=12)
    while not (batch := s.step()).preempted:
        pass
    kept = len(new.token_ids)
    assert kept > 8 and new.num_computed_tokens == 0 and new.num_pending_tokens == kept
    while new not in (batch := s.step()).seqs:
        pass
    assert new.num_computed_tokens == kept and len(new.token_ids) == kept + 1  # all of it again, in one step


def test_fair_share_interleaves_a_late_tenant_with_a_backlogged_one():
    s = Steps(max_num_seqs=1)
    flood = [s.add(tenant="a", max_tokens=2) for _ in range(4)]
    late = [s.add(tenant="b", max_tokens=2) for _ in range(2)]
    s.drain()
    assert s.admitted == [flood[0], late[0], flood[1], late[1], flood[2], flood[3]]


def test_a_heavier_tenant_is_admitted_more_often():
    s = Steps(max_num_seqs=1)
    s.scheduler.waiting.set_weight("heavy", 3.0)
    for _ in range(6):
        s.add(tenant="heavy", max_tokens=1)
        s.add(tenant="light", max_tokens=1)
    s.drain()
    assert [seq.tenant for seq in s.admitted[:4]].count("heavy") == 3


def test_aborting_frees_blocks_and_slots_and_a_waiting_request_never_runs():
    s = Steps(max_num_seqs=1, budget=4, versions=("v1",))
    running = s.add(12, version="v1")
    waiting = s.add(8)
    s.step()  # the first chunk of `running`
    assert s.blocks.num_used_blocks == 1 and s.slots.users == {"v1": 1} and s.host.pins == {"v1": 1}
    s.abort(waiting)
    s.abort(running)
    assert s.blocks.num_used_blocks == 0 and not s.slots.users and not s.host.pins
    assert not s.scheduler.has_unfinished() and s.step().empty
    assert running.finished and waiting.finished and waiting not in s.admitted


def test_n_choices_fork_after_the_prompt_sharing_its_blocks_and_copying_the_one_they_write():
    s = Steps(max_num_seqs=2)
    first = s.add(6, n=2, max_tokens=3)
    other = s.add(4)
    batch = s.step()
    assert batch.seqs == [first] and other in s.scheduler.waiting  # the second choice's seat is held
    child = first.group.seqs[1]
    assert child.status is SequenceStatus.RUNNING and child.block_table == first.block_table
    batch = s.step()
    assert batch.seqs == [first, child] and len(batch.block_copies) == 1
    src, dst = batch.block_copies[0]
    assert first.block_table == [child.block_table[0], dst] and child.block_table[1] == src
    s.drain()
    assert first.token_ids != child.token_ids
    assert [seq.token_ids for seq in (first, child)] == [s.expected_tokens(seq) for seq in (first, child)]


def test_a_request_whose_adapter_cannot_be_loaded_fails_without_holding_up_others():
    s = Steps()
    lost = s.add(version="gone")
    base = s.add()
    assert s.step().seqs == [base] and lost in s.scheduler.waiting
    batch = s.step()
    assert batch.failed and batch.failed[0][0] is lost and lost not in s.scheduler.waiting


def test_adapters_in_use_lists_running_and_waiting_versions():
    s = Steps(max_loras=1, versions=("v1", "v2"))
    s.add(version="v1")
    s.add(version="v2")
    s.add()
    s.step()
    assert s.scheduler.adapters_in_use() == (frozenset({"v1"}), frozenset({"v2"}))


# (prompt length, tenant, adapter version, n, max_tokens, the step before which it is aborted or None, with
# prompt logprobs)
_request = st.tuples(st.integers(1, 20), st.sampled_from(["a", "b", None]), st.sampled_from([None, "v1", "v2", "v3"]),
                     st.integers(1, 2), st.integers(1, 6), st.one_of(st.none(), st.integers(0, 12)), st.booleans())


@settings(max_examples=100, deadline=None)
@given(st.lists(_request, min_size=3, max_size=10), st.sampled_from([7, 10, 16]), st.sampled_from([8, 16, 64]),
       st.integers(2, 4), st.sampled_from([None, 4]), st.sampled_from([PLAIN, StepCost(0.05, 0.5)]),
       st.sampled_from([None, None, 3, 6]))
def test_random_workloads_keep_every_limit_and_finish_every_request_intact(requests, num_blocks, budget, max_num_seqs,
                                                                           cap, step_cost, kv_window):
    # 7 blocks hold the longest request (26 tokens) alone: smaller pools could never finish it. With a
    # kv_window (every layer windowed) blocks behind it are released as sequences run.
    s = Steps(num_blocks, max_num_seqs=max_num_seqs, budget=budget, cap=cap, versions=("v1", "v2", "v3"),
              step_cost=step_cost, kv_window=kv_window)
    seqs = [(s.add(prompt_len, tenant=tenant, version=version, n=n, max_tokens=max_tokens,
                   prompt_logprobs=0 if scored else None), abort_at)
            for prompt_len, tenant, version, n, max_tokens, abort_at, scored in requests]
    for step in itertools.count():
        for seq, abort_at in seqs:
            if abort_at == step:
                s.abort(seq)
        if not s.scheduler.has_unfinished():
            break
        assert step < 500, "the scheduler stopped making progress"
        s.step()
    for seq, abort_at in seqs:
        for choice in seq.group.seqs:
            assert choice.finished
            if choice in s.finished:
                assert choice.token_ids == s.expected_tokens(choice)
        if abort_at is None:
            assert all(choice in s.finished for choice in seq.group.seqs)
    assert s.blocks.num_used_blocks == 0 and not s.slots.users and not s.host.pins
    assert not s.scheduler.running and not s.scheduler.waiting and s.scheduler.fork_seats == 0


def test_a_preempted_tenant_keeps_its_fair_share_credit():
    # Preemption is not idling: the victim's tenant must not be lifted to the others' counters (as one
    # returning from idle is), or the lightest user, the one preempted first, loses what it is owed.
    s = Steps(num_blocks=6)
    s.scheduler.waiting.set_weight("light", 10.0)
    s.add(8, tenant="heavy", max_tokens=12)
    light = s.add(8, tenant="light", max_tokens=12)
    counters = s.scheduler.waiting.counters
    while True:
        owed = counters["light"]
        if s.step().preempted:
            break
    assert light in s.scheduler.waiting and counters["light"] == owed < counters["heavy"] / 5


def _per_tenant(batch: ScheduledBatch) -> dict:
    """Prompt tokens of the step per tenant (decode rows left out)."""
    tokens: dict = {}
    for seq, n in zip(batch.seqs, batch.num_tokens):
        if n > 1:
            tokens[seq.tenant] = tokens.get(seq.tenant, 0) + n
    return tokens


def _decoding(s: Steps, max_tokens: int = 40) -> Sequence:
    victim = s.add(2, tenant="victim", max_tokens=max_tokens)
    s.step()
    assert victim.num_pending_tokens == 1
    return victim


@pytest.mark.parametrize("weights, split", [((1.0, 1.0), (4, 4)), ((3.0, 1.0), (6, 2))])
def test_two_tenants_prompts_share_the_cap_by_fair_share(weights, split):
    s = Steps(budget=64, cap=8)
    for tenant, weight in zip("ab", weights):
        s.scheduler.waiting.set_weight(tenant, weight)
    victim = _decoding(s)
    a, b = s.add(40, tenant="a", max_tokens=1), s.add(40, tenant="b", max_tokens=1)
    for _ in range(4):
        batch = s.step()
        assert victim in batch.seqs and _per_tenant(batch) == dict(zip("ab", split))
    assert a.num_computed_tokens == 4 * split[0] and b.num_computed_tokens == 4 * split[1]


def test_a_tenant_needing_less_than_its_share_leaves_the_rest_to_the_other():
    s = Steps(budget=64, cap=8)
    victim = _decoding(s)
    s.add(40, tenant="a", max_tokens=1)
    s.add(3, tenant="b", max_tokens=1)  # 3 tokens: its 4-token share has one over, which goes to a
    batch = s.step()
    assert victim in batch.seqs and _per_tenant(batch) == {"a": 5, "b": 3}


def test_one_tenants_prompts_share_its_part_not_the_others():
    # Many long prompts from one tenant do not buy it more of the step than the other's one.
    s = Steps(budget=64, cap=8)
    _decoding(s)
    for _ in range(4):
        s.add(40, tenant="a", max_tokens=1)
    s.add(40, tenant="b", max_tokens=1)
    for _ in range(3):
        assert _per_tenant(s.step()) == {"a": 4, "b": 4}


def test_a_decoding_tenant_is_never_starved_by_a_prompt_ahead_of_it():
    # No cap: a long prompt running ahead of a decoding sequence must not take the whole token budget.
    s = Steps(budget=8)
    long = s.add(60, tenant="a", max_tokens=1)
    short = s.add(2, tenant="b", max_tokens=20)
    first = s.step()
    assert first.seqs == [long, short] and first.num_tokens == [6, 2]  # b needs 2 of its 4: a gets the rest
    chunks = []
    while not short.finished:
        batch = s.step()
        assert short in batch.seqs and sum(batch.num_tokens) <= 8
        chunks += [n for seq, n in zip(batch.seqs, batch.num_tokens) if seq is long]
    assert chunks[:7] == [7] * 7 and sum(chunks) == 54  # 7 a step beside the decoding token, to the end


def test_prompt_logprob_positions_and_long_contexts_cost_more_of_the_cap():
    # Each prompt-logprob position costs one token more: a chunk of such a prompt is half the cap.
    s = Steps(budget=64, cap=8, step_cost=StepCost(logits_row=1.0))
    victim = _decoding(s)
    s.add(20, tenant="a", max_tokens=1, prompt_logprobs=2)
    batch = s.step()
    assert victim in batch.seqs and _per_tenant(batch) == {"a": 4}
    # Attention over the context: later chunks of one prompt are shorter, each within the cap.
    cost = StepCost(attention_per_position=0.01)
    s = Steps(budget=64, cap=16, step_cost=cost, num_blocks=128)
    _decoding(s, max_tokens=500)
    long = s.add(200, tenant="a", max_tokens=1)
    chunks = []
    while long.num_pending_tokens > 1:
        start = long.num_computed_tokens
        batch = s.step()
        n = batch.num_tokens[batch.seqs.index(long)]
        assert cost.chunk(long, start, n) <= 16
        chunks.append(n)
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1]


def test_a_prompt_whose_token_costs_more_than_its_share_still_moves_a_token_a_step():
    s = Steps(budget=64, cap=8, step_cost=StepCost(logits_row=20.0))
    victim = _decoding(s)
    scored = s.add(10, tenant="a", max_tokens=1, prompt_logprobs=0)
    for i in range(1, 4):
        batch = s.step()
        assert victim in batch.seqs and scored.num_computed_tokens == i


def _timed(s: Steps, decode_s: float, unit_s: float) -> list[float]:
    """Runs `s` to the end on a simulated clock (a step costs `decode_s` plus `unit_s` per StepCost unit of
    prompt work), each step's time fed back to the scheduler as the engine does; the times of the steps
    in which some sequence decoded."""
    times = []
    for _ in range(2000):
        if not s.scheduler.has_unfinished():
            return times
        batch = s.step()
        seconds = decode_s + unit_s * batch.prompt_work
        s.scheduler.observe(seconds, batch)
        if batch.decoding:
            times.append(seconds)
    raise AssertionError("the scheduler stopped making progress")


def test_the_latency_aware_cap_bounds_a_step_to_its_ratio_of_a_decode_only_step():
    # A decode step costs 10 ms and a prompt token 0.1 ms: 1.25x leaves 2.5 ms, 25 tokens, under the cap of 64.
    s = Steps(budget=128, cap=64, num_blocks=256, latency_cap=LatencyCap(ratio=1.25, floor=4))
    victim = _decoding(s, max_tokens=120)
    s.scheduler.observe(0.010, s.step())  # a decode-only step
    long = s.add(400, tenant="a", max_tokens=1)
    first = s.step()  # no prompt step timed yet: the static cap
    assert _per_tenant(first) == {"a": 64} and first.decoding == 1 and first.prompt_work == 64
    s.scheduler.observe(0.010 + 0.0001 * 64, first)
    times = _timed(s, 0.010, 0.0001)
    assert long.finished and victim.finished
    assert max(times) <= 1.25 * 0.010 + 1e-9 and 0.0125 in {round(t, 9) for t in times}


def test_the_latency_aware_cap_never_starves_a_prompt_below_its_floor():
    # A prompt token costing as much as a whole decode step would get a quarter of one: the floor, 4, holds.
    s = Steps(budget=128, cap=64, num_blocks=128, latency_cap=LatencyCap(ratio=1.25, floor=4))
    victim = _decoding(s, max_tokens=60)
    s.scheduler.latency.decode_seconds, s.scheduler.latency.unit_seconds = 0.010, 0.010
    long = s.add(100, tenant="a", max_tokens=1)
    batch = s.step()
    assert victim in batch.seqs and _per_tenant(batch) == {"a": 4}
    _timed(s, 0.010, 0.010)
    assert long.finished and victim.finished


def test_an_explicit_cap_is_not_bounded_by_step_times():
    s = Steps(budget=64, cap=16)
    _decoding(s)
    s.add(40, tenant="a", max_tokens=1)
    batch = s.step()
    s.scheduler.observe(1.0, batch)  # no latency cap: nothing learns, nothing changes
    assert s.scheduler.latency is None and _per_tenant(s.step()) == {"a": 16}


def test_another_tenants_waiting_or_just_ended_request_caps_a_step_nothing_decodes_in():
    # Nothing decodes, yet the victim's short prompt (waiting) or its next request (a round trip after its
    # last ended) would wait for a whole uncapped step of the long prompt: the cap holds while two tenants
    # are present; the long prompt alone takes the whole budget.
    now = [0.0]
    s = Steps(budget=64, cap=8, num_blocks=128)
    s.scheduler.clock = lambda: now[0]
    long = s.add(200, tenant="a", max_tokens=1)
    s.add(3, tenant="victim", max_tokens=2)
    first = s.step()
    assert _per_tenant(first) == {"a": 5, "victim": 3}  # the cap of 8 split, a taking what the victim leaves
    s.step()  # the victim's last token: it ends
    assert s.scheduler.ended == {"victim": 0.0} and _per_tenant(s.step()) == {"a": 8}  # it may be back any moment
    now[0] = scheduler_module.LINGER_S + 0.01
    assert _per_tenant(s.step()) == {"a": 64}  # it did not come back: a alone, the whole budget
    assert not s.scheduler.ended and long.num_computed_tokens == 5 + 8 + 8 + 64


def test_one_tenants_own_requests_ending_never_cap_its_prompts():
    s = Steps(budget=64, cap=8, num_blocks=128)
    s.add(3, tenant="a", max_tokens=1)
    s.step()  # its one token: it ends
    s.add(100, tenant="a", max_tokens=1)
    assert _per_tenant(s.step()) == {"a": 64}
