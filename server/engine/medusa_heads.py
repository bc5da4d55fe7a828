"""Medusa heads on the device (speculative method `medusa`): the residual blocks of a heads directory
(adapters.medusa_format: files, checks), run over the target's last-layer rows to draft.

Head i maps the last layer's output h (before the final norm) to h + SiLU(W_i h + b_i), and the base
model's final norm and lm_head turn that into logits; the drafts are each head's top-1, one chain (no tree
attention); the target verifies them like any drafts. With a draft vocabulary (the heads file's
`draft_vocab`) the top-1 is over those N lm_head rows alone, copied once here: each drafted head then reads
N / V of the lm_head, where a full row is the step's largest matmul on a CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adapters.medusa_format import HeadWeights
from server.engine.kernel_ops import KernelOps

if TYPE_CHECKING:  # the model imports the LoRA slots, which import this
    from server.engine.model import Model


class MedusaHeads:
    """One set of heads on the device, in the model's dtype: drafts from last-layer rows."""

    def __init__(self, weights: HeadWeights, dtype: torch.dtype, device: torch.device, model: Model) -> None:
        k, h = weights.weight.shape[:2]
        self.num_heads = k
        # All K heads as one [K*H, H] matmul: head i's rows are i*H .. (i+1)*H.
        self.weight = weights.weight.reshape(k * h, h).to(device=device, dtype=dtype).contiguous()
        self.bias = weights.bias.reshape(k * h).to(device=device, dtype=dtype).contiguous()
        self.vocab = None if weights.draft_vocab is None else weights.draft_vocab.to(device)  # [N] token ids
        self.vocab_rows = None if self.vocab is None else model.lm_head_rows(self.vocab)  # their lm_head rows

    @torch.inference_mode()
    def propose(self, h: torch.Tensor, model: Model, ops: KernelOps, k: int) -> torch.Tensor:
        """h [S, H] last-layer rows -> [S, k] drafts (each of the first k heads' top-1, over the draft
        vocabulary if there is one, else over the model's final norm + lm_head)."""
        s, hidden = h.shape
        x = ops.linear(h, self.weight[: k * hidden], self.bias[: k * hidden]).view(s, k, hidden)
        x = (torch.nn.functional.silu(x) + h.unsqueeze(1)).reshape(s * k, hidden)  # the residual block
        if self.vocab is None:
            return model.logits(x, ops).argmax(dim=-1).view(s, k)
        return self.vocab[model.row_logits(x, ops, self.vocab_rows).argmax(dim=-1)].view(s, k)
