"""Medusa heads on the device (speculative method `medusa`): the residual blocks of a heads directory
(adapters.medusa_format: files, checks), run over the target's last-layer rows to draft.

Head i maps the last layer's output h (before the final norm) to h + SiLU(W_i h + b_i), and the base
model's final norm and lm_head turn that into logits; the drafts are each head's top-1, one chain (no tree
attention); the target verifies them like any drafts.
"""
from __future__ import annotations

import torch

from adapters.medusa_format import HeadWeights
from server.engine.kernel_ops import KernelOps


class MedusaHeads:
    """One set of heads on the device, in the model's dtype: drafts from last-layer rows."""

    def __init__(self, weights: HeadWeights, dtype: torch.dtype, device: torch.device) -> None:
        k, h = weights.weight.shape[:2]
        self.num_heads = k
        # All K heads as one [K*H, H] matmul: head i's rows are i*H .. (i+1)*H.
        self.weight = weights.weight.reshape(k * h, h).to(device=device, dtype=dtype).contiguous()
        self.bias = weights.bias.reshape(k * h).to(device=device, dtype=dtype).contiguous()

    @torch.inference_mode()
    def propose(self, h: torch.Tensor, logits, ops: KernelOps, k: int) -> torch.Tensor:
        """h [S, H] last-layer rows -> [S, k] drafts (each of the first k heads' top-1); `logits` is the
        model's final norm + lm_head ([N, H] -> [N, V])."""
        s, hidden = h.shape
        x = ops.linear(h, self.weight[: k * hidden], self.bias[: k * hidden]).view(s, k, hidden)
        x = torch.nn.functional.silu(x) + h.unsqueeze(1)  # the residual block
        return logits(x.reshape(s * k, hidden), ops).argmax(dim=-1).view(s, k)
