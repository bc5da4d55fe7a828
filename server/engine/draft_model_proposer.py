"""A smaller model's greedy drafts (vLLM's `draft_model` method), batched across the step's sequences.

The draft keeps a paged KV pool of its own with as many blocks, of the same size, as the target's, and
writes each sequence's positions at the same block ids the target's block table gives them: the
scheduler has already made room for the step's tokens (the last one and the k drafts) when it asks for
drafts, so every position the draft writes has a block, owned by that sequence. A sequence's draft KV
is its own to rebuild: it starts from position 0 (a prefix-cache hit or a fork gives the target's KV,
not the draft's), after a preemption it starts again, and a block it shares holds the same tokens at
the same positions, so the draft writes the same values there.

Per step: a catch-up over the tokens the draft has not seen (the whole prompt once, then the drafts
the target accepted past the ones the draft wrote itself), in forwards of at most `max_tokens`, then k
one-token passes over every speculating sequence: the last token gives the first draft, each draft
the next. The last draft is never written; rejected positions are overwritten by later passes.

A sequence whose adapter carries a draft LoRA (adapters.draft_lora) drafts with it: its rows take the
draft model's slot matching its target slot (server.engine.lora.draft_slots), from the same activation
point as its target rows; the others run the base draft model. A sequence keeps its adapter, so its
draft KV is always its own adapter's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr

from kernels.metadata import AttentionBatch
from server.engine.kernel_ops import KernelOps
from server.engine.lora.draft_slots import DraftLoraSlots
from server.engine.lora.slots import token_slots
from server.engine.model import CausalLM, StepContext
from server.engine.sequence import Sequence


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's drafts to make this step: k of them after its last token."""

    seq: Sequence
    k: int
    slot: int  # its adapter's slot in the target (-1: the base model), this step's
    # [1, W] int32: a constrained choice's next-token mask (server.engine.mask_lane), ready when the step
    # is scheduled: its first draft is chosen under it, so at least that one is one the grammar allows.
    first_mask: torch.Tensor | None = None

    def draft_slot(self, loras: DraftLoraSlots) -> int:
        return loras.draft_slot(self.slot)


@dataclass
class _DraftState:
    computed: int  # the sequence's leading positions whose draft KV is right
    written_from: int = 0  # where the drafts written last step start (their tokens are `written`)
    written: tuple[int, ...] = ()


class DraftModelProposer:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ops: KernelOps,
                 block_size: int, loras: DraftLoraSlots, lora_scratch: torch.Tensor, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.ops = ops
        self.block_size = block_size
        self.loras = loras  # adapters' draft LoRAs, in the slots their target slots give
        self.lora_scratch = lora_scratch  # [3, max_tokens, max rank]: the shrink's output
        self.device = device
        self.max_tokens = model.workspace.max_tokens
        self.states: dict[Sequence, _DraftState] = {}

    def forget(self, seq: Sequence) -> None:
        """`seq` finished or lost its blocks (preempted): its draft KV is gone with them."""
        self.states.pop(seq, None)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's k greedy drafts after its sequence's last token."""
        if not requests:
            return []
        states = [self._state(r.seq) for r in requests]
        self.loras.sync()  # draft LoRAs copied in this step (CUDA: on the slots' copy stream)
        self._catch_up(requests, states)
        drafts: list[list[int]] = [[] for _ in requests]
        live = list(range(len(requests)))  # requests still drafting
        last = [r.seq.token_ids[-1] for r in requests]
        for j in range(max(r.k for r in requests)):
            live = [i for i in live if len(drafts[i]) < requests[i].k]
            # Position of the token fed: the sequence's last one, then each draft in turn.
            positions = [len(requests[i].seq.token_ids) - 1 + j for i in live]
            tokens = [last[i] if j == 0 else drafts[i][-1] for i in live]
            logits = self._forward([requests[i] for i in live], positions, [[t] for t in tokens], True)
            if j == 0:
                _mask_first(logits, [requests[i].first_mask for i in live])
            for i, t in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[i].append(t)
        for r, state, d in zip(requests, states, drafts):
            # Written: the last token and every draft but the last, at these positions.
            state.computed = len(r.seq.token_ids)
            state.written_from = state.computed
            state.written = tuple(d[:-1])
        return drafts

    def catch_up(self, reqs: list[DraftRequest], counts: list[int]) -> None:
        """The next counts[i] tokens of each request's sequence's catch-up (k unused), without drafting, in
        one forward (their sum within max_tokens): a catch-up longer than a step's token budget, spread over
        steps."""
        starts, chunks = [], []
        for req, n in zip(reqs, counts):
            seq = req.seq
            state = self._state(seq)
            end = min(state.computed + n, len(seq.token_ids) - 1)
            starts.append(state.computed)
            chunks.append(seq.token_ids[state.computed : end])
            state.computed = state.written_from = end
        self._forward(reqs, starts, chunks, False)

    def unseen(self, seq: Sequence) -> int:
        """Tokens before `seq`'s last one that the draft has not run yet: its next catch-up (the scheduler
        counts them, with the k one-token passes, against the step's token budget)."""
        state = self.states.get(seq)
        return len(seq.token_ids) - 1 - (0 if state is None else _seen(state, seq.token_ids))

    def _state(self, seq: Sequence) -> _DraftState:
        """`seq`'s draft state, its drafts the target accepted since counted as computed."""
        state = self.states.get(seq)
        if state is None:
            state = self.states[seq] = _DraftState(0)
            return state
        state.computed = _seen(state, seq.token_ids)
        state.written = ()
        return state

    def _catch_up(self, requests: list[DraftRequest], states: list[_DraftState]) -> None:
        """Draft KV for every token before each sequence's last, in forwards of at most max_tokens."""
        todo = [(r, s.computed, len(r.seq.token_ids) - 1) for r, s in zip(requests, states)]
        todo = [t for t in todo if t[1] < t[2]]
        while todo:
            room = self.max_tokens
            reqs, starts, chunks, rest = [], [], [], []
            for r, start, end in todo:
                n = min(end - start, room)
                if n > 0:
                    reqs.append(r)
                    starts.append(start)
                    chunks.append(r.seq.token_ids[start : start + n])
                    room -= n
                if start + n < end:
                    rest.append((r, start + n, end))
            self._forward(reqs, starts, chunks, False)
            todo = rest

    def _forward(self, reqs: list[DraftRequest], starts: list[int], chunks: list[list[int]],
                 logits: bool) -> torch.Tensor:
        """One forward of the draft: chunk i at positions starts[i].. of reqs[i]'s sequence; the logits at each
        chunk's last token when `logits`, else nothing (the KV is what it was for)."""
        dev = self.device
        lens = [len(c) for c in chunks]
        attn = AttentionBatch.build([r.seq.block_table for r in reqs], starts, lens, self.block_size, dev)
        positions = [p for start, n in zip(starts, lens) for p in range(start, start + n)]
        slots = [s for r, start, n in zip(reqs, starts, lens)
                 for s in token_slots(r.draft_slot(self.loras), start, n, r.seq.group.adapter_from)]
        lora = self.loras.lora_batch(slots, dev)
        ctx = StepContext(ops=self.ops, positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
                          attn=attn, lora=lora, lora_scratch=self.lora_scratch)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long).to(dev, non_blocking=True)
        ends = []
        if logits:
            total = 0
            for n in lens:
                total += n
                ends.append(total - 1)
        rows = torch.tensor(ends, dtype=torch.long).to(dev, non_blocking=True)
        hidden = self.model.hidden_rows(ids, self.kv_caches, ctx, rows)
        return self.model.logits(hidden, self.ops) if logits else hidden


@torch.inference_mode()  # the logits are the forward's inference tensors
def _mask_first(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> None:
    """logits: [N, V], changed in place: row i's tokens outside masks[i] (where given) become -inf."""
    given = [m for m in masks if m is not None]
    if given:
        bitmask = torch.full((len(masks), given[0].shape[-1]), -1, dtype=torch.int32)  # [N, W]: all allowed
        for i, m in enumerate(masks):
            if m is not None:
                bitmask[i] = m[0]
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1])


def _seen(state: _DraftState, tokens: list[int]) -> int:
    """The leading positions whose draft KV is right: those computed, and the drafts written last step up
    to the first the target did not accept."""
    m = 0
    while (m < len(state.written) and state.written_from + m < len(tokens) - 1
           and tokens[state.written_from + m] == state.written[m]):
        m += 1
    return state.written_from + m
