"""Turns a scheduled batch into tensors, runs the model once, and samples.

All per-step metadata (positions, block tables, slot mapping, token ->
adapter slot) is built here once and shared by every layer. Logits are
computed only where they are needed: each sequence's last token when all its
tokens are in, and, for a request that asks for prompt logprobs, the prompt
positions whose logprobs it does not have yet.

A sequence running drafts (speculative decoding) gets logits at its last token and every draft, one
sampling row per position as the plain engine would build it once the drafts before it are its output
(the same output index, so a seeded row draws the same number; penalties see those drafts). Its
result is the longest run of drafts equal to the target's own choices, then the target's choice at
the first mismatch (or after the last draft). A greedy or seeded row so emits the plain engine's tokens.
An unseeded row draws each position from the engine's generator, independently: a draft d is then
accepted with the target's probability p(d), and at the first rejection the token drawn is p's draw
given that it is not d, which is rejection sampling's residual for a draft that is one token (ngram's,
Medusa's top-1, a draft model's greedy one: max(p - onehot(d), 0), normalised). Every emitted token
is so distributed as the target's, with every sampling parameter applied per position (Leviathan et
al. 2023; vLLM's rejection sampler for drafts without probabilities).

A verify step runs the lm_head in rounds, a position only once every draft before it was accepted
(_verify_in_rounds): at batch 1 a rejected first draft costs one lm_head row, as a decode step does,
not k + 1.

With Medusa heads (server.engine.medusa_proposer), the step also keeps the last layer's output at the
logit rows, and each sequence that may speculate gets its next drafts from its row at the position whose
token it chose last (SeqResult.proposed): after the sampled tokens come back, from one row per sequence,
in one more small copy to the host.

A verify step whose rows are all decode rows (the last token and its drafts) runs padded like a decode
step, when the runner pads them (server.engine.decode_graphs: each token a one-token row); with Medusa
heads the padded step keeps the last layer's rows for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kernels.attention_ref import storage
from kernels.host_arrays import host_tensor
from kernels.metadata import AttentionBatch, LoraBatch
from kernels.padded_tables import PaddedTables
from server.engine.decode_graphs import PaddedDecode
from server.engine.draft_length import DraftLength
from server.engine.grammar import GrammarMask
from server.engine.kernel_ops import KernelOps
from server.engine.logprobs import gather_logprobs
from server.engine.lora.page_gathers import PageGathers
from server.engine.lora.slots import token_slots as alora_token_slots
from server.engine.medusa_proposer import MedusaProposer
from server.engine.model import CausalLM, StepContext
from server.engine.sampler import SampleFailure, sample_rows
from server.engine.sampling_row import SamplingRow
# Bound as `sample`: the runner looks it up as a module global each step, so a profiler
# (benchmarks/engine/bench_engine.py) can wrap model_runner.sample.
from server.engine.scheduler import ScheduledBatch, prompt_logprob_span, verifiable
from server.engine.sequence import Sequence, TokenLogprobs


@dataclass(slots=True)
class SeqResult:
    """What one scheduled sequence got from the step."""

    done: bool  # all its tokens are computed (else it ran a prompt chunk)
    # Per choice: n when it forks now; () when scoring. Read, never modified (TokenResults shares them).
    tokens: list[int | SampleFailure] | tuple[int | SampleFailure, ...] = ()
    logprobs: list[TokenLogprobs | None] | tuple[TokenLogprobs | None, ...] = ()  # aligned with tokens
    prompt_logprobs: list[TokenLogprobs] | None = None  # next prompt entries, in order
    drafted: int = 0  # drafts verified: then `tokens` is the run it emits (accepted drafts + the target's)
    proposed: list[int] | tuple[()] = ()  # Medusa drafts for the tokens after its last one
    # Its one token and nothing more (a TokenResults entry: an int token, no logprobs, prompt logprobs,
    # drafts or proposal): post-processing appends it inline (server.engine.output_processor).
    only_token: bool = False


@dataclass(frozen=True)
class MedusaRow:
    """A sequence whose next drafts the heads make this step: its first logit row, adapter slot, and its
    adaptive k (None: it has not speculated yet, so the configured k)."""
    row: int
    slot: int
    length: DraftLength | None


class TokenResults(dict):
    """token -> the result of a sequence that got that token and nothing more (no logprobs, prompt logprobs
    or Medusa proposal): one made per distinct token and shared by every such sequence and step (nothing
    modifies it), instead of one made per sequence per step. At most a vocabulary's worth."""

    def __missing__(self, token: int | SampleFailure) -> SeqResult:
        result = self[token] = SeqResult(True, (token,), (None,), only_token=not isinstance(token, SampleFailure))
        return result


@dataclass
class StepInputs:
    input_ids: torch.Tensor | None  # [T]; None for a padded decode step (its inputs are staged)
    ctx: StepContext | None
    # [S + Q]: the S sampled sequences' last tokens, then Q prompt positions; None for a padded decode step
    # whose rows are those: its logits' leading S + Q rows
    logits_indices: torch.Tensor | None
    num_logits: int  # S + Q
    sampled_seqs: list[int]  # batch positions of the S sequences that get a token this step
    scored_seqs: list[int]  # batch positions whose prompt is in and that generate nothing (max_tokens 0)
    rows: list[SamplingRow]  # tokens to choose: one per choice
    row_starts: list[int]  # sampled sequence s chooses rows[row_starts[s]:row_starts[s + 1]]
    # Logit row of each sampling row, where not the sequence's one (a fork's choices share it, drafts
    # have their own); None: row r reads logits row r
    row_logits: list[int] | None = None
    drafts: dict[int, list[int]] | None = None  # sampled index -> its drafts, when some sequence runs drafts
    # Medusa: sampled index -> (its first logit row, its adapter slot), for the sequences that may speculate
    medusa_rows: dict[int, MedusaRow] | None = None
    prompt: _PromptPositions | None = None
    num_sampled_logits: int = 0  # the leading logit rows that sampling reads (prompt positions follow)
    padded: tuple[int, bool, bool] | None = None  # a padded decode step's (bucket, LoRA, DoRA) key (decode_graphs)
    # A step prepared ahead (async scheduling) whose input ids are not known yet: the padded rows to stage
    # once they are (positions, slot mapping, block tables, token slots); see ModelRunner.fill_ahead.
    ahead_rows: tuple[list[int], list[int], list[list[int]], list[int]] | None = None
    # Every row is a plain decode row (ModelRunner.prepare's runs): none has a grammar, so no mask to gather.
    unconstrained: bool = False


@dataclass(frozen=True)
class _PlainBatch:
    """A step whose rows were all plain decode rows with kept SamplingRows (ModelRunner._kept_plain_rows)."""

    seqs: list[Sequence]
    lora_slots: list[int]
    rows: list[SamplingRow]


@dataclass
class _PromptPositions:
    """Prompt positions whose logits give prompt logprobs: each position's logits give the next token's."""

    rows: list[int] = field(default_factory=list)  # positions in the step's tokens
    seqs: list[int] = field(default_factory=list)  # their sequences' batch positions
    targets: list[int] = field(default_factory=list)  # the next prompt token
    top: list[int] = field(default_factory=list)  # alternatives asked for

    def add(self, i: int, seq: Sequence, first: int, start: int, n: int) -> None:
        """Sequence i (batch position) runs tokens start.. start+n at `first` in the step; the prompt
        entries it has already (before a preemption, or from an earlier chunk) are not made again."""
        lo, hi = prompt_logprob_span(seq, start, n)
        if lo < hi:
            self.rows += range(first + lo - start, first + hi - start)
            self.seqs += [i] * (hi - lo)
            self.targets += seq.token_ids[lo + 1 : hi + 1]
            self.top += [seq.params.prompt_logprobs] * (hi - lo)


class ModelRunner:
    # Whether a verify step may run its layers and its lm_head rows as separate calls (_verify_in_rounds);
    # a tensor-parallel leader's workers run each step as one whole forward, so it may not.
    verifies_in_rounds = True

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: KernelOps,
        block_size: int,
        lora_scratch: torch.Tensor,  # [3, max_tokens, R]
        slot_ranks: list[int],  # live view of LoraSlots.slot_ranks
        rank_table: torch.Tensor | None,  # LoraSlots.rank_table: the same on the device, [L] int32
        device: torch.device,
        seed: int,
        grammar_mask: GrammarMask | None = None,
        slot_dora: list[bool] | None = None,  # live view of LoraSlots.slot_dora
        page_table: torch.Tensor | None = None,  # LoraSlots.page_table: [L, pages] int32 when paged
        page_gathers: PageGathers | None = None,  # paged on a CPU: gathers kept from step to step
        slot_vocab: list[bool] | None = None,  # live view of VocabParts.slot_has: slots with embed/lm_head parts
    ) -> None:
        self.page_table = page_table
        self.page_gathers = page_gathers
        self.slot_vocab = slot_vocab
        self.slot_ranks = slot_ranks
        self.slot_dora = slot_dora
        self.rank_table = rank_table
        self.model = model
        self.kv_caches = kv_caches
        self.kv_groups = model.cfg.kv_groups  # several: a block table per group (server.engine.group_blocks)
        self.ops = ops
        self.block_size = block_size
        self.lora_scratch = lora_scratch
        self.device = device
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.grammar_mask = grammar_mask
        # Decode-only steps padded to a bucket and run from persistent buffers (replayed as CUDA graphs
        # once captured); None: every step eager, unpadded.
        self.padded: PaddedDecode | None = None
        self.medusa: MedusaProposer | None = None  # set by use_medusa()
        self.token_results = TokenResults()
        self.last_lora: tuple[list[int], LoraBatch] | None = None  # the last step's token slots and LoraBatch
        self.last_plain: _PlainBatch | None = None  # the last step, when its rows were all kept plain rows
        # Each KV layer group's padded block tables, kept from step to step (kernels.padded_tables).
        self.kept_tables = [PaddedTables() for _ in range(1 if self.kv_groups is None else self.kv_groups.num_groups)]

    def use_medusa(self, proposer: MedusaProposer) -> None:
        """Propose Medusa drafts every step from now on (before use_padded_decode(): its steps keep the rows
        the heads read)."""
        assert self.padded is None, "use_medusa() before use_padded_decode()"
        self.medusa = proposer

    def use_padded_decode(self, num_slots: int, max_rows: int, max_model_len: int,
                          verify_widths: tuple[int, ...] = (), verify_rows: int = 0) -> PaddedDecode:
        """Run decode-only steps of up to max_rows sequences padded to a bucket from now on, and verify
        steps of up to verify_rows sequences of each of verify_widths tokens (decode_graphs)."""
        if self.kv_groups is not None:
            raise ValueError("padded decode holds one block table per row: not for a model with KV layer groups")
        self.padded = PaddedDecode(self.model, self.kv_caches, self.ops, self.lora_scratch, num_slots, max_rows,
                                   max_model_len, self.block_size, self.device, self.rank_table, self.slot_dora,
                                   self.page_table, verify_widths, verify_rows,
                                   keep_hidden=self.medusa is not None)
        return self.padded

    def prepare(self, batch: ScheduledBatch, ahead: bool = False) -> StepInputs:
        """ahead: a decode-only batch scheduled before the previous step's tokens came back (async
        scheduling, server.engine.async_step): each sequence is one token further on than it records, and
        that token, its input, is filled in by fill_ahead() once sampled. Nothing is staged on the device
        before then, so the step in flight keeps its inputs."""
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[int] = []
        scored: list[int] = []
        rows: list[SamplingRow] = []
        row_starts = [0]
        prompt: _PromptPositions | None = None
        all_drafts = batch.drafts or [()] * len(batch.seqs)
        spec: dict[int, list[int]] | None = None
        row_logits: list[int] = []
        medusa_rows: dict[int, MedusaRow] | None = {} if self.medusa is not None and batch.propose else None
        seqs, num_tokens, lora_slots = batch.seqs, batch.num_tokens, batch.lora_slots
        plain_runs = not ahead and medusa_rows is None
        plain_rows = 0
        at, count = 0, len(seqs)
        kept = self._kept_plain_rows(batch) if plain_runs else None
        if kept is not None:  # the last step's rows again (the usual step): nothing per row but its token
            input_ids, positions, rows = kept
            token_slots, context_lens = lora_slots[:], positions[:]
            row_logits, logits_indices, sampled = list(range(count)), list(range(count)), list(range(count))
            row_starts = list(range(count + 1))
            plain_rows = at = count
        seeded = False  # a plain row built for a seeded sequence: not kept, so not the next step's
        while at < count:
            if plain_runs:
                # A run of the usual decode rows (one token, its last; no drafts, forks, row state or prompt
                # logprobs): inline, what the general path below makes of each, with the bookkeeping that
                # only counts (one logit row and one sampling row each) extended once for the run.
                first_seq, first_token, first_row = at, len(input_ids), len(rows)
                while at < count and num_tokens[at] == 1 and not all_drafts[at]:
                    seq = seqs[at]
                    start, p, group, ids = seq.num_computed_tokens, seq.params, seq.group, seq.token_ids
                    slot = lora_slots[at]
                    if not (start + 1 == len(ids) and p.max_tokens and not (p.has_row_state or group.needs_fork)
                            and group.prompt_logprobs is None and (slot < 0 or group.adapter_from <= start)):
                        break
                    input_ids.append(ids[start])
                    positions.append(start)
                    row = seq.plain_row  # _plain_row(), inline
                    if row is None:
                        row = _plain_row(seq, start + 1 - seq.num_prompt_tokens)
                        seeded = seeded or seq.plain_row is None
                    rows.append(row)
                    at += 1
                if at > first_seq:
                    k = at - first_seq
                    plain_rows += k
                    token_slots += lora_slots[first_seq:at]
                    context_lens += positions[-k:]
                    row_logits += range(len(logits_indices), len(logits_indices) + k)
                    logits_indices += range(first_token, first_token + k)
                    row_starts += range(first_row + 1, first_row + k + 1)
                    sampled += range(first_seq, at)
                    continue
            i = at  # the general path: this sequence's batch position
            at += 1
            seq, n, slot, drafts = seqs[i], num_tokens[i], lora_slots[i], all_drafts[i]
            start = seq.num_computed_tokens + (1 if ahead else 0)
            first = len(input_ids)
            if ahead:
                assert n == 1, "only decode rows are prepared ahead"
                input_ids.append(0)  # the previous step's token: fill_ahead() writes it
            elif drafts:
                input_ids += seq.token_ids[start : start + 1]
                input_ids += drafts
            else:
                input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            token_slots += alora_token_slots(slot, start, n, seq.group.adapter_from)
            context_lens.append(start)
            prompt_lp = seq.group.prompt_logprobs
            if prompt_lp is not None and len(prompt_lp) < seq.num_prompt_tokens:
                prompt = prompt or _PromptPositions()
                prompt.add(i, seq, first, start, n)
            if (medusa_rows is not None and start + n == len(seq.token_ids) + len(drafts) and seq.params.max_tokens
                    and verifiable(seq)):
                medusa_rows[len(sampled)] = MedusaRow(len(logits_indices), slot, batch.draft_lengths.get(seq))
            if drafts:
                spec = spec or {}
                spec[len(sampled)] = drafts
                for j in range(len(drafts) + 1):
                    row_logits.append(len(logits_indices))
                    logits_indices.append(first + j)
                    rows.append(_draft_row(seq, drafts[:j]))
                row_starts.append(len(rows))
                sampled.append(i)
            elif start + n == len(seq.token_ids) + (1 if ahead else 0):
                p = seq.params
                if p.max_tokens == 0:
                    scored.append(i)
                    continue
                if p.has_row_state or seq.group.needs_fork:
                    _add_rows(rows, seq)
                else:  # the usual row: nothing more to read
                    rows.append(seq.plain_row or _plain_row(seq, start + n - seq.num_prompt_tokens))
                row_logits += [len(logits_indices)] * (len(rows) - len(row_logits))
                row_starts.append(len(rows))
                logits_indices.append(len(input_ids) - 1)
                sampled.append(i)
        if kept is None:
            self.last_plain = (_PlainBatch(seqs[:], lora_slots[:], rows)
                               if plain_runs and plain_rows == count and not seeded else None)
        dev = self.device
        num_sampled_logits = len(logits_indices)
        if prompt is not None:
            logits_indices += prompt.rows
        identity = len(row_logits) == num_sampled_logits  # one row per logit row, in order
        common = dict(num_logits=len(logits_indices), sampled_seqs=sampled, scored_seqs=scored, rows=rows,
                      row_starts=row_starts, prompt=prompt, num_sampled_logits=num_sampled_logits,
                      row_logits=None if identity else row_logits, drafts=spec, medusa_rows=medusa_rows or None,
                      unconstrained=plain_rows == len(rows))
        padded = self.padded
        # No slot with embed_tokens/lm_head parts: a padded step's slots are a bound.
        vocab_parts = bool(self.slot_vocab) and any(s >= 0 and self.slot_vocab[s] for s in batch.lora_slots)
        if padded is not None and spec and not (ahead or vocab_parts or prompt is not None):
            staged_verify = self._stage_verify(batch, all_drafts, input_ids, positions, token_slots, logits_indices)
            if staged_verify is not None:
                key, indices = staged_verify
                return StepInputs(None, None, indices, padded=key, **common)
        # One token each.
        if padded is not None and len(input_ids) == len(batch.seqs) <= padded.max_rows and not vocab_parts:
            bs = self.block_size
            tables = [s.block_table for s in batch.seqs]
            staged = (positions, [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], tables, token_slots)
            leading = logits_indices == list(range(len(logits_indices)))  # the usual case: no copy to make
            indices = None if leading else host_tensor(logits_indices).to(dev, non_blocking=True)
            if ahead:
                return StepInputs(None, None, indices, ahead_rows=staged, **common)
            return StepInputs(None, None, indices, padded=padded.stage(input_ids, *staged), **common)
        kept = self.kept_tables
        attn = AttentionBatch.build(
            [s.block_table for s in batch.seqs], context_lens, batch.num_tokens, self.block_size, dev, kept[0]
        )
        # The other KV layer groups' tables (server.engine.group_blocks), each its own AttentionBatch.
        groups = self.kv_groups
        group_attn = (attn, *(AttentionBatch.build([s.group_tables[g] for s in batch.seqs], context_lens,
                                                   batch.num_tokens, self.block_size, dev, kept[g + 1])
                              for g in range(groups.num_groups - 1))) if groups is not None else ()
        ctx = StepContext(
            ops=self.ops,
            positions=host_tensor(positions).to(dev, non_blocking=True),
            attn=attn,
            lora=self._lora_batch(token_slots),
            lora_scratch=self.lora_scratch,
            group_attn=group_attn,
        )
        ids = None if ahead else host_tensor(input_ids).to(dev, non_blocking=True)
        return StepInputs(ids, ctx, host_tensor(logits_indices).to(dev, non_blocking=True), **common)

    def _kept_plain_rows(self, batch: ScheduledBatch) -> tuple[list[int], list[int], list[SamplingRow]] | None:
        """vLLM V1's persistent batch, for the usual step: when the last step's rows were all plain decode rows
        with kept SamplingRows (Sequence.plain_row) and this step runs the same sequences in the same order
        with the same adapter slots, each its one newest token, then every row is what the last step made
        of it: its (input ids, positions, rows), with no per-row checks; else None. What makes a row plain
        is fixed for a sequence while it runs (its params and group, an aLoRA's start behind it), but that
        it runs its newest token and only that, which is checked."""
        last = self.last_plain
        seqs = batch.seqs
        if (last is None or last.seqs != seqs or last.lora_slots != batch.lora_slots
                or batch.num_tokens.count(1) != len(seqs) or any(batch.drafts)):
            return None
        ids = [seq.token_ids for seq in seqs]
        positions = [seq.num_computed_tokens for seq in seqs]
        if list(map(len, ids)) != [p + 1 for p in positions]:
            return None
        return [t[-1] for t in ids], positions, last.rows[:]

    def _stage_verify(self, batch: ScheduledBatch, all_drafts, input_ids: list[int], positions: list[int],
                      token_slots: list[int], logits_indices: list[int]
                      ) -> tuple[tuple[int, bool, bool], torch.Tensor] | None:
        """A verify step staged padded (every row its last token and its drafts, widened to the widest
        row's count): its (bucket, LoRA, DoRA) key and the padded rows of its logits, in
        logits_indices' order; None when it runs eager (a row that is not a decode row, or a shape
        without a padded bucket)."""
        padded = self.padded
        counts = batch.num_tokens
        if any(n != 1 + len(d) for n, d in zip(counts, all_drafts)):
            return None  # a prompt chunk
        width = max(counts)
        bucket = padded.verify_bucket(len(counts), width)
        if bucket is None:
            return None
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        mapping: list[int] = []
        tables: list[list[int]] = []
        where: list[int] = []  # the padded row of each of the step's tokens
        bs, first = self.block_size, 0
        for seq, n in zip(batch.seqs, counts):
            table = seq.block_table
            where += range(len(ids), len(ids) + n)
            ids += input_ids[first : first + n]
            pos += positions[first : first + n]
            slots += token_slots[first : first + n]
            mapping += [table[p // bs] * bs + p % bs for p in positions[first : first + n]]
            tables += [table] * n
            pad = width - n  # padding tokens: no KV written, no adapter, one cached key read
            ids += [0] * pad
            pos += [0] * pad
            slots += [-1] * pad
            mapping += [-1] * pad
            tables += [[0]] * pad
            first += n
        key = padded.stage_verify(bucket, width, ids, pos, mapping, tables, slots)
        rows = host_tensor([where[i] for i in logits_indices]).to(self.device, non_blocking=True)
        return key, rows

    def _lora_batch(self, token_slots: list[int]) -> LoraBatch:
        """The step's LoraBatch: the previous step's when its token slots are the same (decoding sequences
        that stay, the usual step) and its slots' ranks and DoRA flags too, else built. A LoraBatch is read,
        never written, by the step that uses it, and what its scratch holds derives from its own fields."""
        gathers = self.page_gathers and self.page_gathers.for_step(token_slots)
        last = self.last_lora
        if gathers is None and last is not None and last[0] == token_slots:
            lora = last[1]
            active, ranks, dora = lora.active_slots, self.slot_ranks, self.slot_dora
            if ((ranks is None or lora.rank_bound == max((ranks[s] for s in active), default=0))
                    and lora.dora == (dora is not None and any(dora[s] for s in active))):
                return lora
        lora = LoraBatch.build(token_slots, self.device, self.slot_ranks, self.rank_table, self.slot_dora,
                               self.page_table, gathers)
        self.last_lora = (token_slots, lora) if gathers is None else None
        return lora

    def fill_ahead(self, inputs: StepInputs, input_ids: list[int]) -> StepInputs:
        """A step prepared ahead with its input ids [T], the previous step's sampled tokens: staged now, in
        order behind the previous step (the one host-to-device copy of a padded step)."""
        if inputs.ahead_rows is not None:
            return replace(inputs, padded=self.padded.stage(input_ids, *inputs.ahead_rows), ahead_rows=None)
        return replace(inputs, input_ids=host_tensor(input_ids).to(self.device, non_blocking=True))

    def run(self, batch: ScheduledBatch) -> dict[int, SeqResult]:
        """Batch position -> what that sequence got, for sequences that finished their pending tokens
        or made prompt logprobs. An exception here is the engine's, not one request's: it ends the loop."""
        inputs = self.prepare(batch)
        if batch.block_copies:
            self._copy_blocks(batch.block_copies)
        return self.execute(inputs)

    def execute(self, inputs: StepInputs) -> dict[int, SeqResult]:
        """The forward and sampling of a prepared step (run(), less the preparing): what run() returns."""
        hidden = None
        # Drafts, one row per logit row and no prompt logprobs: the lm_head runs a position only once
        # every draft before it was accepted (_verify_in_rounds). Not a padded verify step: its forward is
        # one staged launch (a graph on CUDA), lm_head included.
        in_rounds = (self.verifies_in_rounds and bool(inputs.drafts) and inputs.padded is None
                     and inputs.row_logits is None and inputs.prompt is None)
        if inputs.padded is not None:
            logits, hidden = self._run_padded(inputs)  # [S+Q, V], and [S+Q, H] for Medusa rows
        elif inputs.medusa_rows is not None or in_rounds:  # eager: the last layer's rows are kept
            hidden = self.model.hidden_rows(inputs.input_ids, self.kv_caches, inputs.ctx, inputs.logits_indices)
            logits = None if in_rounds else self.model.logits(hidden, self.ops, inputs.ctx.lora,
                                                              inputs.logits_indices)
        else:
            logits = self.forward(inputs)  # [S+Q, V]
        results = {i: SeqResult(True) for i in inputs.scored_seqs}
        sampled, starts = inputs.sampled_seqs, inputs.row_starts
        if inputs.drafts:
            _settle_checks(inputs)
        if in_rounds:
            results.update(self._verify_in_rounds(inputs, hidden))
            if inputs.medusa_rows is not None:
                self._propose(inputs, hidden, results)
        elif sampled:
            row_logits = logits[: inputs.num_sampled_logits]  # [S', V]
            if inputs.row_logits is not None:  # a request forks now: its n choices share one row
                row_logits = row_logits.index_select(0, torch.tensor(inputs.row_logits, device=logits.device))
            mask = self.grammar_mask
            bitmask = (mask.gather([r.grammar for r in inputs.rows])  # [rows, W] int32
                       if mask is not None and not inputs.unconstrained else None)
            out = sample_rows(row_logits, inputs.rows, self.generator, mask, bitmask)
            if bitmask is not None:
                _fail_costly_constraints(inputs.rows, out.tokens)
            drafts = inputs.drafts or {}
            if not drafts and len(out.tokens) == len(sampled):  # one row each: row s is sequence s's
                if (hidden is None and inputs.prompt is None
                        and out.logprobs.count(None) == len(sampled)):  # nothing else modifies a result
                    results.update(zip(sampled, map(self.token_results.__getitem__, out.tokens)))
                else:
                    for i, token, logprob in zip(sampled, out.tokens, out.logprobs):
                        results[i] = SeqResult(True, (token,), (logprob,))
            else:
                results.update(_run_results(sampled, starts, drafts, out.tokens, out.logprobs))
            if hidden is not None:
                self._propose(inputs, hidden, results)
        prompt = inputs.prompt
        if prompt is not None:
            targets = torch.tensor(prompt.targets, dtype=torch.long)
            entries = gather_logprobs(logits[inputs.num_sampled_logits :], targets, prompt.top)
            for i, entry in zip(prompt.seqs, entries):
                result = results.setdefault(i, SeqResult(False))
                if result.prompt_logprobs is None:
                    result.prompt_logprobs = []
                result.prompt_logprobs.append(entry)
        return results

    def _verify_in_rounds(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[int, SeqResult]:
        """A step with drafts, its lm_head and sampling in rounds: first every sequence's first row, then
        each speculating sequence's next row only while its drafts keep matching the target's choices.

        A row after a rejected draft is never used, so computing it was the verify's main waste on a CPU:
        the lm_head is a [V, H] matmul whose cost grows with its rows (about 2.4x at 5 rows against 1),
        where the layers' matmuls barely do. A greedy or seeded row's choices are the ones one pass over
        every row makes (drawn from its own logits and output index); an unseeded row's draws are
        independent per position either way, so its tokens keep the same distribution. The other rows
        are all in the first round, in batch order, as before."""
        drafts, starts, sampled = inputs.drafts, inputs.row_starts, inputs.sampled_seqs
        tokens: list = [None] * len(inputs.rows)
        logprobs: list = [None] * len(inputs.rows)
        depth = {s: 0 for s in drafts}  # speculating sequence -> the position its next round samples
        batch = [r for s in range(len(sampled)) for r in (range(starts[s], starts[s + 1]) if s not in drafts
                                                           else (starts[s],))]
        mask = self.grammar_mask
        while batch:
            index = host_tensor(batch).to(hidden.device, non_blocking=True)
            logits = self.model.logits(hidden.index_select(0, index), self.ops, inputs.ctx.lora,
                                       inputs.logits_indices.index_select(0, index))
            rows = [inputs.rows[r] for r in batch]
            bitmask = mask.gather([r.grammar for r in rows]) if mask is not None else None
            out = sample_rows(logits, rows, self.generator, mask, bitmask)
            if bitmask is not None:
                _fail_costly_constraints(rows, out.tokens)
            for r, token, logprob in zip(batch, out.tokens, out.logprobs):
                tokens[r], logprobs[r] = token, logprob
            batch = []
            for s, j in list(depth.items()):
                if j < len(drafts[s]) and tokens[starts[s] + j] == drafts[s][j]:
                    depth[s] = j + 1
                    batch.append(starts[s] + j + 1)
                else:
                    del depth[s]
        return _run_results(sampled, starts, drafts, tokens, logprobs)

    def _propose(self, inputs: StepInputs, hidden: torch.Tensor, results: dict[int, SeqResult]) -> None:
        """Each speculating sequence's next Medusa drafts, from its row at the position it chose its last
        token at (its first row plus the drafts it accepted)."""
        sampled, drafts = inputs.sampled_seqs, inputs.drafts or {}
        rows, slots, seqs, ks = [], [], [], []
        for s, medusa in inputs.medusa_rows.items():
            result = results[sampled[s]]
            accepted = len(result.tokens) - 1 if s in drafts else 0
            # As many heads as its adaptive k will take next step: each is a row through the lm_head
            # (its draft vocabulary's rows, if the heads have one).
            k = self.medusa.k if medusa.length is None else medusa.length.k_after(len(drafts.get(s, ())), accepted)
            if k:
                rows.append(medusa.row + accepted)
                slots.append(medusa.slot)
                seqs.append(sampled[s])
                ks.append(k)
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long).to(hidden.device, non_blocking=True)
        proposed = self.medusa.propose(hidden.index_select(0, index), slots, self.ops, max(ks))
        proposed = [p[:k] for p, k in zip(proposed, ks)]
        for i, p in zip(seqs, proposed):
            results[i].proposed = p

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [S+Q, V] of an eager step's sampled and prompt-logprob rows."""
        return self.model.forward(inputs.input_ids, self.kv_caches, inputs.ctx, inputs.logits_indices)

    def _run_padded(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A padded step's logits [S+Q, V] and, when it has Medusa rows, the last layer's rows [S+Q, H],
        each in logits_indices' order."""
        out = self.padded.run(inputs.padded)  # every row of the bucket, padding included
        index = inputs.logits_indices

        def pick(rows: torch.Tensor) -> torch.Tensor:
            return rows[: inputs.num_logits] if index is None else rows.index_select(0, index)
        hidden = out.hidden if inputs.medusa_rows is not None else None
        return pick(out.logits), None if hidden is None else pick(hidden)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_blocks(self.kv_caches, copies, self.device)

    def shutdown(self) -> None:
        """Nothing to release here (a tensor-parallel leader stops its workers: server.engine.parallel)."""


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies, device: torch.device) -> None:
    """Copy-on-write: each (source, copy) block's K/V, every layer, before the forward writes."""
    src = torch.tensor([s for s, _ in copies], dtype=torch.long).to(device, non_blocking=True)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long).to(device, non_blocking=True)
    # Layers of different KV layer groups share a pool tensor (server.engine.kv_groups): each copied once.
    for kv in {id(kv): kv for kv in kv_caches}.values():  # each [num_blocks, block_size, Hkv, D]
        for cache in map(storage, kv):  # bytes: CPU index_copy_ has no fp8 kernel
            cache.index_copy_(0, dst, cache.index_select(0, src))


def _fail_costly_constraints(rows: list[SamplingRow], tokens: list[int | SampleFailure]) -> None:
    """A choice whose constraint ran past its mask budget (server.engine.mask_lane) gets its failure, not
    a token: its request ends with an error naming the constraint."""
    for i, row in enumerate(rows):
        if row.grammar is not None and row.grammar.failure is not None:
            tokens[i] = SampleFailure(row.grammar.failure)


# A token id no choice equals: a draft the step ran but may not accept.
UNCHECKED = -1


def _settle_checks(inputs: StepInputs) -> None:
    """After the forward, before sampling: each constrained choice whose draft model's drafts its grammar
    checked during the step (server.engine.mask_lane) may accept only those the check accepted, or none
    where it is still running (the step never waits for one). The others stay drafted (the step ran
    them) but are never accepted."""
    for s, drafts in inputs.drafts.items():
        grammar = inputs.rows[inputs.row_starts[s]].grammar
        checked = grammar.settle_check() if grammar is not None else None
        if checked is not None and checked < len(drafts):
            inputs.drafts[s] = drafts[:checked] + [UNCHECKED] * (len(drafts) - checked)


def _run_results(sampled: list[int], starts: list[int], drafts: dict[int, list[int]], tokens: list,
                 logprobs: list) -> dict[int, SeqResult]:
    """Each sampled sequence's result from the step's row tokens: its rows' choices, or for a sequence
    that ran drafts, its accepted drafts and the target's choice after them."""
    results = {}
    for s, i in enumerate(sampled):
        a, b = starts[s], starts[s + 1]
        if s in drafts:
            b = a + _accepted(drafts[s], tokens[a:b]) + 1
            results[i] = SeqResult(True, tokens[a:b], logprobs[a:b], drafted=len(drafts[s]))
        else:
            results[i] = SeqResult(True, tokens[a:b], logprobs[a:b])
    return results


def _accepted(drafts: list[int], chosen: list[int | SampleFailure]) -> int:
    """How many leading drafts equal the target's own choices at their positions."""
    m = 0
    while m < len(drafts) and chosen[m] == drafts[m]:
        m += 1
    return m


def _plain_row(seq: Sequence, output_index: int) -> SamplingRow:
    """The row of a sequence whose sampling reads only its params and choice (no row state, no fork), at
    `output_index`. Without a seed nothing reads that index (only a seeded draw and min_tokens do), so the
    row is kept on the sequence and reused every step: one row built per sequence, not per step."""
    row = SamplingRow(seq.params, seq.index, output_index)
    if seq.params.seed is None:
        seq.plain_row = row
    return row


def _draft_row(seq: Sequence, before: list[int]) -> SamplingRow:
    """The row the plain engine would sample `seq` with once `before` (drafts) are its output too."""
    p = seq.params
    output_index = seq.num_output_tokens + len(before)
    output_counts = {}
    if p.has_penalties:
        output_counts = dict(seq.output_counts())
        for token in before:
            output_counts[token] = output_counts.get(token, 0) + 1
    prompt_ids = seq.group.distinct_prompt_ids() if p.repetition_penalty != 1.0 else None
    stop_ids = seq.group.min_tokens_stop_ids if output_index < p.min_tokens else ()
    grammar = seq.grammar.position(len(before)) if seq.grammar is not None else None  # its mask after `before`
    return SamplingRow(p, seq.index, output_index, output_counts, prompt_ids, stop_ids, grammar)


def _add_rows(rows: list[SamplingRow], seq: Sequence) -> None:
    """The tokens `seq` chooses now, when they need more than its params: one, or one per choice
    when its request forks at this step."""
    p = seq.params
    group = seq.group
    output_index = seq.num_output_tokens
    fork = group.needs_fork
    # Penalty inputs are read only by the rows that use them, and kept up to date a token at a time.
    output_counts = seq.output_counts() if p.has_penalties else {}
    prompt_ids = group.distinct_prompt_ids() if p.repetition_penalty != 1.0 else None
    stop_ids = group.min_tokens_stop_ids if output_index < p.min_tokens else ()
    rows += [SamplingRow(p, c, output_index, output_counts, prompt_ids, stop_ids, group.seqs[c].grammar)
             for c in (range(group.n) if fork else (seq.index,))]
