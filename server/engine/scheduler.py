"""Continuous batching: which sequences run this step, and how many of their tokens (Scheduler); the
waiting queue in tenant fair-share order (FairQueue); what a prompt chunk costs a step (StepCost);
speculative decoding's counters (SpecDecodeCounters, reported as SpecDecodeStats).

Every step, decoding sequences go first (one token each), then running
prompts get their next chunk, then waiting ones are admitted in fair-share
order while the token budget, `max_num_seqs`, KV blocks and adapter slots
allow. A waiting request whose adapter is still loading never holds up the
others. When blocks run out, the newest running sequence is preempted: its
blocks are freed and it is recomputed from its tokens when readmitted.

Fair steps: the step's prompt work is split between the tenants that have
some by weighted max-min fair share (FairQueue.shares), so many long prompts
of one tenant share its part, not everyone's; what a share leaves unused goes
to the chunks already in the step. While any running sequence is decoding (or
more than one tenant is present: Scheduler._shared),
that work is capped by `max_prefill_tokens_while_decoding` (when set), counted
in decode-token equivalents (StepCost, below: a late token of a long
prompt attends over more positions, a prompt-logprob position runs the
lm_head): a long prompt is then prefilled in chunks of bounded cost between
decode steps instead of in one step that stalls every decoding stream for its
whole duration (one tenant's 2,000-token prompt would otherwise hold up
everyone's next token for seconds on a CPU). With a latency cap, the cap
shrinks further to what keeps such a step within a ratio of a decode-only
step's measured time (Scheduler.observe learns each step's), and a new adapter's slot load is charged
against the same cap at what a load was measured to add to a step (server.engine.step_latency.load_units):
a storm of distinct adapters' first requests then loads about what the cap allows per step, at least one
per tenant, instead of a slot load and a prefill per free slot in one step.

A request for n choices is admitted as its choice 0 alone; once that prompt
is prefilled the other choices fork from it, sharing its blocks. A sequence
about to write into a shared block gets a private copy first: the copies are
listed in the batch, for the runner to make before the forward pass.

A constrained sequence whose next token's grammar mask is still being filled (off the step, on
server.engine.mask_lane's threads) sits out the steps until it is ready; prompt chunks that sample
nothing need no mask.

With every layer of the model windowed (SchedulerLimits.kv_window), a running sequence's blocks
wholly behind its window are returned to the pool before each step (BlockManager.release_before), so
a long conversation holds about its window's blocks, not its length's. With windowed layers interleaved
with global ones (SchedulerLimits.kv_groups), a sequence has a block table per layer group and only the
windowed groups' are released (server.engine.group_blocks).

An admitted sequence starts with the longest run of its full blocks found in
the prefix cache (server.engine.block_manager) and computes only the rest, in
chunks as usual. Cached blocks nobody holds count as free: taking one costs a
block like allocating one does, so the cache never crowds out running work.

With speculative decoding (server.engine.speculative_config), a decoding sequence (not forking now:
verifiable) runs its last token plus up to k drafts (server.engine.ngram_proposer, Medusa heads' or a
draft model's: server.engine.draft_model_proposer; a constrained choice, those of next_drafts its
grammar accepted when its masks were filled off the step, server.engine.mask_lane, or a draft model's,
checked by its grammar while the step runs); they count against
the token budget and get KV slots like any token; a draft model's work counts too (its catch-up over the
tokens it has not seen and one token per draft), k shrinking to what the budget holds; when not one
draft fits, the catch-up runs as far as the budget holds, without drafts, so a long prompt's draft
catches up over several steps. A draft model always makes the k asked for, so room for them is made
first and the drafts are made at the end of schedule(), in one batch over the sequences still in the
step. The output processor rolls back what the model rejects. Each sequence's k adapts to its acceptance
(server.engine.draft_length); no step speculates while disable_by_batch_size sequences run; a request
may opt out (SamplingParams.speculative).

The waiting queue (FairQueue), ordered by tenant fair share (virtual token counters, as in VTC).

Each tenant's counter is charged its prompt tokens (when admitted) and its
output tokens (as generated), divided by the tenant's weight; the backlogged
tenant with the lowest counter goes next, so one tenant flooding the queue
cannot starve the others. A tenant returning from idle is lifted to the
lowest counter among active tenants, so idling does not bank credit.
Within a tenant: lower `priority` value first, then arrival order.

What a prompt chunk costs a step (StepCost), in decode-token equivalents, for the prefill cap while others decode.

A chunk's tokens are not equal: each attends over every position before it, and a position whose prompt
logprobs are asked for also runs the lm_head and a log-softmax over the vocabulary. Late in a long
prompt, and with prompt logprobs, a 256-token chunk costs several times 256 ordinary tokens, and every
decoding stream waits for it. Counted here from the model's shape (multiply-adds relative to one
token's projections and MLP), so the cap bounds a step's work, not only its token count; the relative
costs stay deterministic. With SchedulerLimits.latency_cap (`auto` on a CPU) the cap itself is bounded
further from the engine's measured step times (server.engine.step_latency: what a unit costs in seconds).

Speculative decoding's counters since start (SpecDecodeCounters, SpecDecodeStats), vLLM's `spec_decode`
metrics: verify steps run (one per sequence and step that had drafts), drafts verified, drafts accepted
(in all and by draft position), and decode steps run without drafts because the batch was past the cut-off.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from adapters.host_tier import HostTier
from server.engine.block_manager import FREED, BlockManager, PrefixCache
from server.engine.config import ModelConfig
from server.engine.draft_length import DraftLength
from server.engine.draft_model_proposer import DraftModelProposer, DraftRequest
from server.engine.group_blocks import GroupedPrefixCache, KvTables
from server.engine.lora.slot_share import SlotShare
from server.engine.lora.slots import LoraSlots, adapter_from
from server.engine.ngram_proposer import propose
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.speculative_config import SpeculativeConfig
from server.engine.step_latency import LatencyCap, StepLatency, StepTiming


@dataclass(frozen=True)
class SpecDecodeStats:
    method: str | None = None  # None: speculative decoding is off
    num_drafts: int = 0  # vLLM's spec_decode_num_drafts: sequences' verify steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [j]: verify steps that accepted draft j (0-based)
    skipped_steps: int = 0  # steps whose batch was too large to speculate (disable_by_batch_size)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step emits on average: its accepted drafts and the target's own (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecodeCounters:
    """The mutable side: the output processor counts verify steps, the scheduler skipped steps."""

    def __init__(self, method: str | None) -> None:
        self.method = method
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.skipped_steps = 0

    def verified(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.method, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_position), self.skipped_steps)


PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0  # decode tokens cost a forward each; S-LoRA's VTC weighs them 2x


class FairQueue:
    def __init__(self) -> None:
        self.queues: dict[str | None, list[tuple[int, int, Sequence]]] = {}  # tenant -> sorted (prio, arrival, seq)
        self.counters: dict[str | None, float] = {}
        self.weights: dict[str | None, float] = {}
        self.active: dict[str | None, int] = {}  # tenant -> running requests

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def __contains__(self, seq: Sequence) -> bool:
        return any(entry[2] is seq for entry in self.queues.get(seq.tenant, ()))

    def set_weight(self, tenant: str | None, weight: float) -> None:
        assert weight > 0
        self.weights[tenant] = weight

    def push(self, seq: Sequence) -> None:
        tenant = seq.tenant
        if not self.queues.get(tenant) and not self.active.get(tenant):
            self._lift(tenant)
        bisect.insort(self.queues.setdefault(tenant, []), (seq.priority, seq.arrival, seq), key=_order)

    def remove(self, seq: Sequence) -> None:
        q = self.queues[seq.tenant]
        q.pop(next(i for i, entry in enumerate(q) if entry[2] is seq))

    def ordered(self) -> Iterator[Sequence]:
        """Waiting sequences in the order to admit them, as if each were admitted in turn.

        A heap over tenants keeps each step O(log tenants), so thousands of tenants stay cheap.
        """
        # (projected counter, tie-break by name, unique index so tenants never compare, tenant, head)
        heap = [(self.counters.get(t, 0.0), str(t), i, t, 0) for i, (t, q) in enumerate(self.queues.items()) if q]
        heapq.heapify(heap)
        while heap:
            projected, key, i, tenant, head = heapq.heappop(heap)
            queue = self.queues[tenant]
            seq = queue[head][2]
            yield seq
            if head + 1 < len(queue):
                cost = seq.num_prompt_tokens * PROMPT_TOKEN_COST / self.weights.get(tenant, 1.0)
                heapq.heappush(heap, (projected + cost, key, i, tenant, head + 1))

    def admitted(self, seq: Sequence) -> None:
        """`seq` left the queue to run: charge its (uncached) prompt."""
        self.remove(seq)
        self.started_running(seq)
        self.charge(seq.tenant, seq.num_pending_tokens * PROMPT_TOKEN_COST)

    def started_running(self, seq: Sequence) -> None:
        """`seq` runs: admitted, or forked from a sibling (which charged the shared prompt once)."""
        self.active[seq.tenant] = self.active.get(seq.tenant, 0) + 1

    def stopped_running(self, seq: Sequence) -> None:
        self.active[seq.tenant] -= 1
        if not self.active[seq.tenant]:
            del self.active[seq.tenant]

    def charge_output(self, seq: Sequence, tokens: int = 1) -> None:
        """Every choice's tokens count: n choices cost n times the decoding."""
        self.charge(seq.tenant, tokens * OUTPUT_TOKEN_COST)

    def uncharge_output(self, tenant: str | None, tokens: int) -> None:
        """Take back `tokens` output tokens charged to `tenant` that its client was never given (generated
        past a stop string its front end found: server.engine.choice_abort); none when tokens <= 0."""
        if tokens > 0:
            self.charge(tenant, -tokens * OUTPUT_TOKEN_COST)

    def charge_outputs(self, tokens: dict[str | None, int]) -> None:
        """charge_output of one token, `tokens[tenant]` times for each tenant: the same additions (the
        same float counters), with no call per token."""
        counters = self.counters
        for tenant, count in tokens.items():
            cost, counter = OUTPUT_TOKEN_COST / self.weights.get(tenant, 1.0), counters.get(tenant, 0.0)
            for _ in range(count):
                counter += cost
            counters[tenant] = counter

    def charge(self, tenant: str | None, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, 1.0)

    def shares(self, demands: dict[str | None, float], total: float) -> dict[str | None, float]:
        """`total` (one step's prefill budget) split between the tenants with `demands` on it by weighted
        max-min fair share: each gets its weight's part, and what a tenant needs less of goes to the
        others in the same proportions."""
        shares: dict[str | None, float] = {}
        left = total
        pending = sorted(demands, key=lambda t: demands[t] / self.weights.get(t, 1.0))
        weight = sum(self.weights.get(t, 1.0) for t in pending)
        for tenant in pending:  # smallest demand per weight first: it is the one that may leave some over
            w = self.weights.get(tenant, 1.0)
            shares[tenant] = min(demands[tenant], left * w / weight)
            left -= shares[tenant]
            weight -= w
        return shares

    def _lift(self, tenant: str | None) -> None:
        others = [self.counters.get(t, 0.0) for t in set(self.active) | {t for t, q in self.queues.items() if q}]
        if others:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))


def _order(entry: tuple[int, int, Sequence]) -> tuple[int, int]:
    return entry[0], entry[1]


@dataclass(frozen=True)
class StepCost:
    attention_per_position: float = 0.0  # one query token attending one earlier position
    logits_row: float = 0.0  # one prompt position's logits (lm_head), for its prompt logprobs
    # Every layer windowed (ModelConfig.kv_window): a token attends at most this many positions.
    window: int | None = None

    def __post_init__(self) -> None:
        assert self.attention_per_position >= 0 and self.logits_row >= 0

    @classmethod
    def of(cls, mcfg: ModelConfig) -> StepCost:
        q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
        per_layer = mcfg.hidden_size * (2 * q + 2 * kv + 3 * mcfg.intermediate_size)  # q, k, v, o, gate/up/down
        return cls(attention_per_position=2 * q / per_layer,  # QK^T and PV, per layer like the projections
                   logits_row=mcfg.hidden_size * mcfg.vocab_size / (mcfg.num_layers * per_layer),
                   window=mcfg.kv_window)

    @property
    def plain(self) -> bool:
        return not (self.attention_per_position or self.logits_row)

    def chunk(self, seq: Sequence, start: int, n: int) -> float:
        """Cost of computing `seq`'s tokens start..start+n."""
        if self.plain:
            return float(n)
        attended = _attended(start + 1, start + n, self.window)  # token i attends start + i + 1 positions
        lo, hi = prompt_logprob_span(seq, start, n)
        return n + self.attention_per_position * attended + self.logits_row * max(0, hi - lo)

    def fit(self, seq: Sequence, start: int, most: int, allowance: float) -> int:
        """The most tokens (<= `most`) of `seq` from `start` whose chunk costs at most `allowance`."""
        allowance += SLACK  # shares are float splits of an integer cap: 7.999999 tokens is 8
        if self.plain:
            return max(0, min(most, int(allowance)))
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.chunk(seq, start, mid) <= allowance:
                lo = mid
            else:
                hi = mid - 1
        return lo


PLAIN = StepCost()
SLACK = 1e-6


def _attended(lo: int, hi: int, window: int | None) -> float:
    """sum of min(p, window) over p = lo..hi: the positions queries lo-1..hi-1 attend."""
    top = hi if window is None else min(hi, window)
    below = (lo + top) * (top - lo + 1) / 2 if top >= lo else 0.0
    return below + (0 if window is None else window * max(0, hi - max(lo - 1, window)))


def prompt_logprob_span(seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """Prompt positions lo..hi among start..start+n whose logits give prompt logprobs still owed (each
    position's logits give the next token's); lo >= hi when none."""
    owed = seq.group.prompt_logprobs
    if owed is None:
        return 0, 0
    return max(start, len(owed) - 1), min(start + n, seq.num_prompt_tokens - 1)


# After this many steps blocked on an adapter slot, the head of the queue stops letting requests
# of its own tenant, or of tenants above their share of the slots, join adapters already in a slot,
# so every adapter gets its turn (base-model requests always pass: they need no slot).
MAX_BYPASS_STEPS = 32
# Distinct not-yet-resident adapters, nearest the head of the queue, loaded ahead of admission.
PREFETCH_WINDOW = 8
# Waiting requests looked at per step (in fair-share order); the rest wait their turn, so a
# queue of many thousands costs a step no more than this.
SCAN_HORIZON = 1024
# How long a tenant whose request just ended still counts as present for the prefill cap: a streaming
# client's next request is a round trip away, and an uncapped step started meanwhile (a whole long prompt
# at once) would hold that request's first token for as long.
LINGER_S = 0.25


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_while_decoding: int | None = None  # None: prompts may take the whole token budget
    speculative: SpeculativeConfig | None = None  # None: one token per decode step
    # What a prompt token costs against the cap while decoding (StepCost); PLAIN: 1 each.
    step_cost: StepCost = PLAIN
    # Every layer windowed (ModelConfig.kv_window): blocks wholly behind a sequence's window go back to
    # the pool before each step. None: a sequence keeps all its blocks.
    kv_window: int | None = None
    # Windowed layers interleaved with global ones: each KV layer group's window (server.engine.kv_groups),
    # group 0 a global one; () for a model with one group.
    kv_groups: tuple[int | None, ...] = ()
    # The cap bounded further by measured step times (server.engine.step_latency; `auto` on a CPU); None:
    # the cap as given.
    latency_cap: LatencyCap | None = None

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return self.kv_groups or (self.kv_window,)

    def __post_init__(self) -> None:
        assert not (self.kv_groups and self.kv_window), "an interleaved model has no window over every layer"
        assert self.max_num_seqs > 0 and self.max_num_batched_tokens > 0
        assert self.max_prefill_tokens_while_decoding is None or self.max_prefill_tokens_while_decoding > 0
        assert self.latency_cap is None or self.max_prefill_tokens_while_decoding is not None, \
            "the latency-aware cap bounds a cap: it needs one"


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per sequence
    lora_slots: list[int] = field(default_factory=list)  # adapter slot per sequence, -1 = base model
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # adapter load failed: (seq, error)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy), copy-on-write
    # Per sequence: the draft tokens run after its last token (speculative decoding); () for most.
    drafts: list[list[int] | tuple[()]] = field(default_factory=list)
    # With the latency-aware cap (SchedulerLimits.latency_cap): the step's decoding rows and its prompt
    # work in StepCost units, what Scheduler.observe learns from once the step has run.
    decoding: int = 0
    prompt_work: float = 0.0
    slot_loads: int = 0  # adapters the step copied into device slots
    # Medusa: each speculating sequence's adaptive k (read, not changed, to draft only what it will use)
    draft_lengths: dict[Sequence, DraftLength] = field(default_factory=dict)
    # Whether the next step may speculate (the running batch, as this step leaves it, is under
    # disable_by_batch_size): only then do Medusa heads draft for it. Past the cut-off a step runs as a
    # plain one (no kept hidden rows, no heads' lm_head rows for drafts nobody would verify).
    propose: bool = False

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SchedulerStats:
    running: int  # sequences in the running batch
    waiting: int  # requests waiting to be admitted
    preemptions: int  # since start
    running_adapters: frozenset[str]  # adapter versions of the running requests
    waiting_adapters: frozenset[str]  # adapter versions of the waiting requests
    # Output tokens appended since start, every choice's: those a front end's stop string cut off too (the
    # steps a ChoiceAbort saves show here: server.engine.choice_abort).
    generated_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerLimits, blocks: BlockManager, lora_slots: LoraSlots, host: HostTier,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.ended: dict[str | None, float] = {}  # tenant -> when its last request ended (within LINGER_S)
        self.blocks = blocks
        self.kv = KvTables(blocks, config.group_windows)  # every KV layer group's table of a sequence
        self.prefix_cache = (GroupedPrefixCache(blocks, config.kv_groups) if config.kv_groups
                             else PrefixCache(blocks, config.kv_window))
        self.lora_slots = lora_slots
        self.host = host
        self.waiting = FairQueue()
        self.running: list[Sequence] = []
        self.lora_slot_of_seq: dict[Sequence, int] = {}  # pinned adapter slot of each running sequence
        self.waited_for_load: set[Sequence] = set()
        # Adapter versions the waiting requests scanned last step need: the host tier keeps them when
        # it makes room for a finished load, so prefetching one never evicts another still waited for.
        self.wanted: set[str] = set()
        self.head_blocked_steps = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # the output processor counts them as it appends them
        # Seats in the running batch held for choices that fork once their choice 0's prompt is in.
        self.fork_seats = 0
        self.slot_load_seconds: deque[float] = deque(maxlen=4096)  # recent copies into a slot, drained by metrics
        # Copies into a slot since start (each step's count goes to its batch) and their seconds (for benchmarks).
        self.slot_loads = 0
        self.slot_loads_s = 0.0
        spec = config.speculative
        self.spec_counters = SpecDecodeCounters(spec.method if spec is not None else None)
        self.draft_lengths: dict[Sequence, DraftLength] = {}  # per running sequence: its adaptive k
        self.draft_model: DraftModelProposer | None = None  # the draft_model method's (engine_startup sets it)
        self.latency = StepLatency(config.latency_cap) if config.latency_cap is not None else None
        self.last_prompt_budget: float | None = None  # the last step's capped prompt work (None: uncapped)

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def adapters_in_use(self) -> tuple[frozenset[str], frozenset[str]]:
        """Distinct adapter versions of the running and of the waiting requests (the base model: none),
        what a LoRA-aware router reads to send a request where its adapter is already loaded."""
        running = frozenset(s.version_id for s in self.running if s.version_id is not None)
        waiting = frozenset(entry[2].version_id for queue in self.waiting.queues.values() for entry in queue
                            if entry[2].version_id is not None)
        return running, waiting

    def stats(self) -> SchedulerStats:
        running_adapters, waiting_adapters = self.adapters_in_use()
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, running_adapters,
                              waiting_adapters, self.num_generated_tokens)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_prefill_tokens_while_decoding
        capped = cap is not None and (any(s.num_pending_tokens == 1 for s in self.running) or self._shared())
        if self.kv.windowed:
            for seq in self.running:
                self.release_behind_window(seq)
        speculate = self._speculate()
        catch_ups: dict[Sequence, int] = {}  # draft catch-up run this step without drafts (_catch_up)
        prompts: list[Sequence] = []
        running = SequenceStatus.RUNNING
        writes_own_block, slot_of = self.kv.writes_own_block, self.lora_slot_of_seq.get
        for seq in list(self.running):  # decoding sequences first: no prompt chunk can take their tokens
            pending = len(seq.token_ids) - seq.num_computed_tokens
            if pending > 1:
                prompts.append(seq)
                continue
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this loop
            if (pending == 1 and not speculate and seq.grammar is None
                    and writes_own_block(seq, seq.num_computed_tokens + 1)):
                # The usual decode row, inline: one token into a block of its own (what the general path
                # below does for it, at no per-sequence call).
                batch.seqs.append(seq)
                batch.num_tokens.append(1)
                batch.lora_slots.append(slot_of(seq, -1))
                batch.drafts.append(())
                budget -= 1
                continue
            n = min(pending, budget)
            drafts = self._drafts(seq, budget - 1) if n and speculate else ()
            work = self._draft_work(seq, len(drafts))
            catch_up = self._catch_up(seq, budget - n) if n and speculate and not drafts else 0
            n += len(drafts)
            if n == 0 or (seq.grammar is not None and not _mask_ready(seq, seq.num_computed_tokens + n)) \
                    or not self._make_room(seq, n, batch):
                continue
            self._add_to_batch(batch, seq, n, drafts)
            if seq in self.draft_lengths:
                batch.draft_lengths[seq] = self.draft_lengths[seq]
            budget -= n + work + catch_up
            if catch_up:
                catch_ups[seq] = catch_up
        # The step's prompt work: while others decode, the cap in decode-token equivalents (server.engine.
        # step_cost), else the tokens left; split between tenants by fair share, whatever is left over
        # going to prompts that could use it.
        cost = self.config.step_cost if capped else PLAIN
        total = (cap if self.latency is None else self.latency.cap(cap)) if capped else budget
        load = self.latency.load_units() if capped and self.latency is not None else 0.0  # one slot load's units
        self.last_prompt_budget = total if capped else None
        scan = list(itertools.islice(self.waiting.ordered(), SCAN_HORIZON))
        demands = self._demands(prompts, scan, budget, cost, total, load)
        prefill = _PrefillShares(cost, self.waiting.shares(demands, total), total, load)
        loads = self.slot_loads
        for seq in prompts:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            start = seq.num_computed_tokens
            n = prefill.chunk(seq, start, min(seq.num_pending_tokens, budget))
            if n == 0 or not _mask_ready(seq, start + n) or not self._make_room(seq, n, batch):
                continue
            self._add_to_batch(batch, seq, n, ())
            prefill.spend(seq, start, n)
            budget -= n
        budget = self._admit(batch, budget, prefill, scan, admit=not batch.preempted)
        self._share_leftover(batch, budget, prefill)
        if self.draft_model is not None and speculate:
            self._draft_with_model(batch, catch_ups)
        # The next step may speculate when the batch, as this step leaves it, is under the cut-off (when
        # requests end, the first step under it has no Medusa drafts).
        batch.propose = self._under_cut_off()
        if self.latency is not None:
            self._measure(batch, prefill.chunked)
            batch.slot_loads = self.slot_loads - loads
        return batch

    def _shared(self) -> bool:
        """Whether more than one tenant is present: running, waiting, or its last request ended within LINGER_S.
        Then a step's prompt work is capped though nothing decodes, so one tenant's long prompt cannot hold
        another's first token (its prompt waiting, or its next request on its way) for a whole uncapped step;
        a tenant alone still takes the whole token budget."""
        now = self.clock()
        for tenant in [t for t, at in self.ended.items() if now - at > LINGER_S]:
            del self.ended[tenant]
        present = set(self.ended)
        for tenant in itertools.chain((s.tenant for s in self.running), (t for t, q in self.waiting.queues.items() if q)):
            present.add(tenant)
            if len(present) > 1:
                return True
        return False

    def _measure(self, batch: ScheduledBatch, chunked: set[Sequence]) -> None:
        """The batch's decoding rows and prompt work (StepCost units, whether or not the step was capped), for
        observe()."""
        if not chunked:  # the usual decode-only step: every row decodes
            batch.decoding += len(batch.seqs)
            return
        cost = self.config.step_cost
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq in chunked:
                batch.prompt_work += cost.chunk(seq, seq.num_computed_tokens, n)
            else:
                batch.decoding += 1

    def observe(self, seconds: float, batch: ScheduledBatch) -> None:
        """`batch` took `seconds` from schedule() to its outputs: the latency-aware cap's estimates learn it."""
        if self.latency is not None:
            self.latency.observe(StepTiming(seconds, batch.decoding, batch.prompt_work, batch.slot_loads))

    def _draft_with_model(self, batch: ScheduledBatch, catch_ups: dict[Sequence, int]) -> None:
        """The draft model's drafts for the sequences given room for them (placeholders until now), made
        once every preemption of the step is done, in one batch; before them, the catch-ups run alone."""
        running = [DraftRequest(s, 0, slot) for s, slot in zip(batch.seqs, batch.lora_slots)
                   if s in catch_ups and s.status is SequenceStatus.RUNNING]
        if running:
            self.draft_model.catch_up(running, [catch_ups[r.seq] for r in running])
        rows = [i for i, d in enumerate(batch.drafts) if d]
        requests = [DraftRequest(batch.seqs[i], len(batch.drafts[i]), batch.lora_slots[i],
                                 None if batch.seqs[i].grammar is None else batch.seqs[i].grammar.row(0))
                    for i in rows]
        for i, drafts in zip(rows, self.draft_model.propose(requests)):
            batch.drafts[i] = drafts
            grammar = batch.seqs[i].grammar
            if grammar is not None:  # its masks for them are filled while the step runs
                grammar.check_drafts(drafts)

    def _demands(self, prompts: list[Sequence], scan: list[Sequence], budget: int, cost: StepCost,
                 total: float, load: float) -> dict[str | None, float]:
        """Each tenant's prompt work this step could use: its running prompts' next chunks and the
        prompts of its waiting requests that could start (adapter resident; `load` more where it must be
        copied into a slot), up to `total`."""
        demands: dict[str | None, float] = {}
        for seq in prompts:
            if seq.status is SequenceStatus.RUNNING:
                want = cost.chunk(seq, seq.num_computed_tokens, min(seq.num_pending_tokens, budget))
                demands[seq.tenant] = demands.get(seq.tenant, 0.0) + want
        if len(self.running) + self.fork_seats < self.config.max_num_seqs:
            for seq in scan:
                have = demands.get(seq.tenant, 0.0)
                version = seq.version_id
                if have < total and (version is None or self.host.ready(version)):
                    copy = load if version is not None and version not in self.lora_slots.slot_of else 0.0
                    demands[seq.tenant] = have + copy + cost.chunk(seq, 0, min(len(seq.token_ids), budget))
        return {t: min(d, total) for t, d in demands.items()}

    def _share_leftover(self, batch: ScheduledBatch, budget: int, prefill: _PrefillShares) -> None:
        """Prompt work a tenant's share left unused (its prompts were short, or could not start) goes to
        the prompt chunks in the batch, lightest tenant first, so the step's budget is not wasted."""
        left = prefill.left
        chunks = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                  if seq in prefill.chunked and n < seq.num_pending_tokens]
        chunks.sort(key=lambda i: self.waiting.counters.get(batch.seqs[i].tenant, 0.0))
        for i in chunks:
            if left <= 0 or budget == 0:
                break
            seq, n = batch.seqs[i], batch.num_tokens[i]
            start = seq.num_computed_tokens
            used = prefill.cost.chunk(seq, start, n)
            m = prefill.cost.fit(seq, start, min(seq.num_pending_tokens, n + budget), used + left)
            # Only into free blocks (one kept spare for decoding): a leftover never preempts anyone.
            if m <= n or not _mask_ready(seq, start + m) or not self.kv.can_grow(seq, start + m, 1):
                continue
            self.kv.grow(seq, start + m)
            batch.num_tokens[i] = m
            budget -= m - n
            left -= prefill.cost.chunk(seq, start, m) - used

    def _under_cut_off(self) -> bool:
        """Speculative decoding is on and the running batch is smaller than its disable_by_batch_size (past
        it, verifying costs the batch more than drafts save)."""
        spec = self.config.speculative
        return spec is not None and len(self.running) < spec.disable_by_batch_size

    def _speculate(self) -> bool:
        """Whether this step proposes drafts (_under_cut_off); a step past the cut-off is counted skipped."""
        if self._under_cut_off():
            return True
        if self.config.speculative is not None:
            self.spec_counters.skipped_steps += 1
        return False

    def _drafts(self, seq: Sequence, room: int) -> list[int] | tuple[()]:
        """Drafts for decoding `seq`, none past what it may still generate (the token after the drafts is
        the target's own), with the draft's own work (_draft_work) they cost within `room` tokens: k
        shrinks to fit, and none are made when not even one fits; () while it forks, or where the request
        opted out."""
        spec = self.config.speculative
        if spec is None or not verifiable(seq):
            return ()
        length = self.draft_lengths.get(seq)
        if length is None:
            length = self.draft_lengths[seq] = DraftLength(spec.num_speculative_tokens)
        if self.draft_model is not None:  # each draft is verified and costs the draft a one-token pass
            room = (room - self.draft_model.unseen(seq)) // 2
        k = min(length.next_k(), room, seq.params.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return ()
        if seq.grammar is not None and self.draft_model is None:
            # The drafts its masks were filled for, those the grammar accepts.
            return list(seq.grammar.drafts[:k]) if seq.grammar.ready else ()
        if seq.grammar is not None and not seq.grammar.can_check:
            return ()  # the draft model's drafts are checked in the step, one check at a time
        if spec.method == "draft_model":
            return [0] * k  # placeholders: the draft model fills them in (_draft_with_model)
        return self._proposals(seq, k) or ()

    def _proposals(self, seq: Sequence, k: int) -> list[int]:
        """Up to k drafts for `seq` from a method that makes them outside the step: the heads' last guesses
        (medusa) or prompt lookup's (ngram)."""
        spec = self.config.speculative
        if spec.method == "medusa":
            return list(seq.proposed[:k])
        return propose(seq.token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min) or []

    @property
    def grammar_drafts(self) -> int:
        """The most drafts a constrained choice's masks are filled for (server.engine.mask_lane): k, or 0
        without speculative decoding."""
        spec = self.config.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    def next_drafts(self, seq: Sequence) -> list[int]:
        """The drafts `seq`'s next step may verify, proposed once this step's tokens are in, for a constrained
        choice's masks to be filled for them off the step (server.engine.mask_lane): as many as its adaptive
        k may take; none where it will not speculate, nor with a draft model (its drafts are made in the
        step and checked there: LaneMatcher.check_drafts)."""
        if not self.grammar_drafts or self.draft_model is not None or not verifiable(seq) or not self._under_cut_off():
            return []
        length = self.draft_lengths.get(seq)
        k = self.grammar_drafts if length is None else length.peek()
        k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return self._proposals(seq, k) if k > 0 else []

    def _draft_work(self, seq: Sequence, k: int) -> int:
        """Tokens the draft model runs to make `seq`'s k drafts: its catch-up over the tokens it has not
        seen, then one pass per draft (each feeds one token); 0 without a draft model or drafts."""
        if self.draft_model is None or not k:
            return 0
        return self.draft_model.unseen(seq) + k

    def _catch_up(self, seq: Sequence, room: int) -> int:
        """Tokens of a draft model's catch-up for `seq` to run this step without drafts: when its catch-up
        leaves no room for one draft, as much of it as `room` holds (a prompt longer than the budget is
        caught up over several steps, then drafts); 0 otherwise."""
        if self.draft_model is None or room <= 0 or not verifiable(seq):
            return 0
        unseen = self.draft_model.unseen(seq)
        return min(unseen, room) if unseen > room - 2 else 0

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """`seq` verified `drafted` drafts and the target accepted `accepted` of them: counted, and its k
        adapted."""
        self.spec_counters.verified(drafted, accepted)
        self.draft_lengths[seq].verified(drafted, accepted)

    def finish(self, seq: Sequence) -> None:
        """Return a finished (or aborted) sequence's blocks, adapter slot and host pin."""
        self.ended[seq.tenant] = self.clock()
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.waited_for_load.discard(seq)
        self.draft_lengths.pop(seq, None)
        if self.draft_model is not None:
            self.draft_model.forget(seq)
        seq.status = SequenceStatus.FINISHED

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start the other choices of `parent`'s request, whose prompt `parent` has just prefilled:
        they share its blocks and adapter slot, and charge no prompt (it ran once)."""
        group = parent.group
        group.needs_fork = False
        children = group.seqs[1:]
        self.fork_seats -= len(children)
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent, child)
            # Same tokens so far: the same block hashes, and the same blocks already indexed.
            child.block_hashes = list(parent.block_hashes)
            child.num_registered_blocks = parent.num_registered_blocks
            if parent in self.lora_slot_of_seq:
                version = child.version_id
                self.lora_slot_of_seq[child] = self._acquire_slot(version)
                self.host.pin(version)
            self.waiting.started_running(child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return children

    def _acquire_slot(self, version: str) -> int:
        """Pin `version`'s slot for one more request; a copy into the slot is timed (its tier's load latency)."""
        copying = version not in self.lora_slots.slot_of
        start = time.perf_counter()
        slot = self.lora_slots.acquire(version, self.host.get(version))
        if copying:
            seconds = time.perf_counter() - start
            self.slot_load_seconds.append(seconds)
            self.slot_loads += 1
            self.slot_loads_s += seconds
        return slot

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Private blocks for `seq`'s next `n` tokens, preempting the newest running sequences while
        the pool is short; False if `seq` itself went."""
        end = seq.num_computed_tokens + n
        if self.kv.writes_own_block(seq, end):
            return True  # most decode steps: the last block has room and is this sequence's own
        while True:
            # Recomputed after each preemption: a preempted sibling may have left a block unshared.
            shared = self.kv.shared_written(seq, end)
            if self.kv.blocks_needed(seq, end) + len(shared) <= self.blocks.num_free_blocks:
                break
            if self.lora_slots.units is not None and self.lora_slots.evict_idle():
                continue  # --unified-memory: an idle adapter's pages go before any sequence
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        for group, i in shared:
            batch.block_copies.append(self.kv.copy_on_write(seq, group, i))
        self.kv.grow(seq, end)
        return True

    def _admit(self, batch: ScheduledBatch, budget: int, prefill: _PrefillShares, scan: list[Sequence],
               admit: bool) -> int:
        """Admits waiting requests in fair-share order into what is left of the step; the tokens left."""
        failed = self.host.collect(self.wanted)
        self.wanted = set()
        head_blocked = False
        head_tenant: str | None = None
        slot_share: SlotShare | None = None  # computed once per step, only when the head has waited long
        prefetching: set[str] = set()  # distinct versions, so many requests for one load use one place
        for seq in scan:
            version = seq.version_id
            if version is not None:
                self.wanted.add(version)
            if version is not None and not self.host.ready(version):
                if version in failed:
                    self.waiting.remove(seq)
                    batch.failed.append((seq, failed[version]))
                elif version in prefetching or len(prefetching) < PREFETCH_WINDOW:
                    prefetching.add(version)
                    self.host.prefetch(version)
                    self.waited_for_load.add(seq)
                continue  # waits for its own load without holding anyone up
            # A request for n choices is n running sequences once it forks: room for all of them.
            joining = seq.group.n if seq.group.needs_fork else 1
            if not admit or budget == 0 or len(self.running) + self.fork_seats + joining > self.config.max_num_seqs:
                continue  # keep scanning only to start loads for requests near the head
            unified = self.lora_slots.units is not None  # its pages are made room for with its KV, below
            if version is not None and not self.lora_slots.can_acquire(version, self.host.entries.get(version),
                                                                        pages=not unified):
                if not head_blocked:
                    head_blocked = True
                    self.head_blocked_steps += 1
                    head_tenant = seq.tenant
                continue
            if head_blocked and version is not None:
                # Only requests that need no new slot (base model, or an adapter already in use) may pass
                # a head blocked on slots. Base-model ones always do: they hold no slot, so they never delay
                # the head's. An adapter in use keeps its slot busy while requests join it, so after a
                # while the head's tenant, and tenants above their weighted share of the slots, stop
                # joining theirs; those slots drain to let the head in, while a tenant within its share
                # keeps its slot, so one tenant's many adapters cannot take every slot from the others.
                if version not in self.lora_slots.users:
                    continue
                if self.head_blocked_steps > MAX_BYPASS_STEPS:
                    if slot_share is None:
                        slot_share = SlotShare.of(self.running, self.lora_slot_of_seq, self.waiting.weights,
                                                  self.lora_slots.max_loras, head_tenant)
                    if seq.tenant == head_tenant or slot_share.over(seq.tenant):
                        continue
            assert seq.num_computed_tokens == 0, "a waiting sequence has computed nothing"
            if version is not None:  # before the lookup: the point decides which blocks are the base's
                seq.group.adapter_from = adapter_from(self.host.get(version), seq.prompt_token_ids)
            hit = self.prefix_cache.lookup_tables(seq)
            tables = hit or [[] for _ in self.config.group_windows]
            start = len(tables[0]) * self.blocks.block_size
            # A new adapter's copy into a slot is charged against its tenant's share, beside its prompt chunk.
            load = prefill.slot_load if version is not None and version not in self.lora_slots.slot_of else 0.0
            n = prefill.chunk(seq, start, min(len(seq.token_ids) - start, budget), load)
            if n == 0:
                continue  # its tenant's share of the step is spent: it starts in a later step
            if not _mask_ready(seq, start + n):
                continue  # its first mask is still being filled: admitted next step, no one held up
            # Keep one block spare so running sequences can decode without preempting at once; cached
            # blocks nobody holds come out of the free pool when taken.
            spare = 1 if self.running else 0
            if unified:
                fits = self._unified_room(seq, tables, start + n, spare, batch)
            else:
                need = sum(self.blocks.blocks_needed(t, start + n) for t in tables)
                fits = need + spare + self.kv.num_unreferenced(tables) <= self.blocks.num_free_blocks
            if not fits:
                admit = False
                continue
            self.kv.take(seq, tables)  # before grow, which could otherwise evict them
            seq.num_computed_tokens = start
            self.prefix_cache.admitted(seq, hit and hit[0])
            self.release_behind_window(seq)  # cached blocks it will never read
            if version is not None:  # before grow: --unified-memory's pages need whole groups of units
                if seq not in self.waited_for_load:
                    self.host.note_hit()
                self.waited_for_load.discard(seq)
                self.lora_slot_of_seq[seq] = self._acquire_slot(version)
                self.host.pin(version)
            self.kv.grow(seq, start + n)
            self.waiting.admitted(seq)  # charges the uncached tokens only
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.fork_seats += joining - 1
            self._add_to_batch(batch, seq, n, ())
            prefill.spend(seq, start, n, load)
            budget -= n
        if not head_blocked:
            self.head_blocked_steps = 0
        self.lora_slots.sync()
        return budget

    def _unified_room(self, seq: Sequence, tables: list[list[int]], tokens: int, spare: int,
                      batch: ScheduledBatch) -> bool:
        """--unified-memory (server.engine.unified_memory): whether the pool has the blocks for `seq`'s first
        `tokens` tokens past its cached `tables` (one per KV layer group), `spare` more, and its adapter's pages
        when they must be loaded; made by evicting idle adapters (never its own) and then, for an adapter load only, by
        preempting running sequences that arrived after `seq`, the newest first."""
        version = seq.version_id
        loading = version is not None and version not in self.lora_slots.slot_of
        units = self.lora_slots.units
        pages = self.lora_slots.pages_for(self.host.get(version)) if loading else 0
        taking = frozenset(b for t in tables for b in t if b != FREED)  # its cached blocks: no page may take them
        while True:
            # Cached blocks nobody holds count as free until taken: recounted, a preemption may add some.
            need = (sum(self.blocks.blocks_needed(t, tokens) for t in tables) + spare
                    + self.kv.num_unreferenced(tables))
            # A page is an aligned group of units nobody holds (BlockManager.lend), not any free blocks.
            if need + units.units_for(pages) <= self.blocks.num_free_blocks and (
                    not pages or units.room(taking) >= pages):
                return True
            if self.lora_slots.evict_idle(keep=version):
                continue
            newer = [s for s in self.running if s.arrival > seq.arrival]
            if not loading or not newer:
                return False
            self._preempt(max(newer, key=lambda s: s.arrival), batch)

    def release_behind_window(self, seq: Sequence) -> None:
        """Return `seq`'s blocks wholly behind the window of its next query (position num_computed_tokens:
        it sees keys from num_computed_tokens + 1 - window on). Nothing rolls num_computed_tokens back
        past that query (rejected drafts come after it), so no step reads them again."""
        self.kv.release_behind_window(seq)

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int, drafts: list[int] | tuple[()]) -> None:
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        batch.lora_slots.append(self.lora_slot_of_seq.get(seq, -1))
        batch.drafts.append(drafts)

    def roll_back(self, seq: Sequence) -> None:
        """Return the blocks of `seq`'s table wholly past its computed tokens: they held only drafts
        the model rejected (nothing indexes them: only full computed blocks are cached)."""
        self.kv.roll_back(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, back into the queue."""
        # Queued while it still counts as running: a preempted tenant did not idle, so the fair queue
        # must not lift its counter to the others' (that would take the credit of the lightest user).
        self.waiting.push(seq)
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        if self.draft_model is not None:
            self.draft_model.forget(seq)  # its draft KV went with its blocks
        self.num_preemptions += 1
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            for column in (batch.seqs, batch.num_tokens, batch.lora_slots, batch.drafts):
                del column[i]
        batch.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.group.needs_fork:
            self.fork_seats -= seq.group.n - 1
        self.kv.free(seq)
        self.waiting.stopped_running(seq)
        if self.lora_slot_of_seq.pop(seq, None) is not None:
            self.lora_slots.release(seq.version_id)
            self.host.unpin(seq.version_id)


def verifiable(seq: Sequence) -> bool:
    """Whether `seq` takes drafts for its next tokens: it did not opt out, not forking now. Every sampling
    mode verifies exactly (server.engine.model_runner): greedy and seeded rows choose the plain engine's
    tokens, unseeded ones keep the target's distribution (rejection sampling); a constrained choice's
    verify positions are each masked as the plain engine would mask them (server.engine.mask_lane)."""
    return seq.params.speculative and not seq.group.needs_fork


def _mask_ready(seq: Sequence, end: int) -> bool:
    """Whether `seq` may compute its tokens up to `end` this step: a step that samples a constrained
    choice runs only once its mask is filled (server.engine.mask_lane), and until then the choice sits
    out, keeping its blocks and seat, so the batch never waits on one request's grammar. Prompt chunks
    that sample nothing run regardless."""
    if seq.grammar is None or end < len(seq.token_ids) or seq.params.max_tokens == 0:
        return True
    choices = seq.group.seqs if seq.group.needs_fork else (seq,)  # a fork samples every choice's first token
    return all(c.grammar.ready for c in choices)


class _PrefillShares:
    """One step's prompt work per tenant: its fair share (cost units) and what it has spent; `slot_load`:
    what a new adapter's copy into a slot costs against it (0: not charged)."""

    def __init__(self, cost: StepCost, shares: dict[str | None, float], total: float, slot_load: float = 0.0) -> None:
        self.cost = cost
        self.slot_load = slot_load
        self.allowance = dict(shares)
        self.left = total  # the step's whole prompt budget, less what chunks spent
        self.fresh = set(shares)  # tenants with no chunk in the step yet
        self.chunked: set[Sequence] = set()

    def chunk(self, seq: Sequence, start: int, most: int, load: float = 0.0) -> int:
        """Tokens of `seq` from `start` (<= `most`) its tenant's share still allows beside `load` (its adapter's
        copy into a slot). A tenant's first chunk of the step gets at least one token, and its slot load, even
        where they cost more than its share, so no prompt waits forever while others decode (the cap is then
        passed by at most one token's cost, or one slot load, per tenant)."""
        allowance = self.allowance.get(seq.tenant, 0.0)
        n = self.cost.fit(seq, start, most, allowance - load)
        if n == 0 and most > 0 and seq.tenant in self.fresh:
            return max(1, self.cost.fit(seq, start, most, allowance))
        return n

    def spend(self, seq: Sequence, start: int, n: int, load: float = 0.0) -> None:
        spent = self.cost.chunk(seq, start, n) + load
        self.allowance[seq.tenant] = self.allowance.get(seq.tenant, 0.0) - spent
        self.left -= spent
        self.fresh.discard(seq.tenant)
        self.chunked.add(seq)
