"""A sparse MoE block (Mixtral, Qwen3-MoE) with LoRA on its experts, as transformers 5 computes it.

The router's softmax is taken in float32 over every expert, the top k kept and, where the model says so,
renormalised (Mixtral always: the softmax over the top-k logits; Qwen3-MoE by `norm_topk_prob`). The
routed (token, expert) pairs are grouped by expert (kernels.expert_batch): one base matmul per expert
hit, and each fused expert weight's LoRA in one backend call over every expert and adapter
(server.engine.lora.backends: apply_experts). Outputs are weighted and summed per token in expert order,
as transformers' index_add does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.expert_batch import ExpertBatch
from server.engine.config import ModelConfig
from server.engine.lora.expert_buffers import ExpertLoraBuffers
from server.engine.moe_weights import ExpertWeights


class MoeBlock:
    def __init__(self, cfg: ModelConfig, weights: ExpertWeights, gate_up_lora: ExpertLoraBuffers,
                 down_lora: ExpertLoraBuffers) -> None:
        self.cfg = cfg
        self.router, self.gate_up, self.down = weights.router, weights.gate_up, weights.down
        self.gate_up_lora, self.down_lora = gate_up_lora, down_lora
        # Qwen3-MoE casts the router weights back to the activations' dtype; Mixtral keeps them float32.
        self.cast_weights = cfg.architecture == "Qwen3MoeForCausalLM"

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.router, self.gate_up, self.down]

    def route(self, x: torch.Tensor, ctx) -> ExpertBatch:
        """x [T, H] -> the step's pairs, sorted by (expert, slot)."""
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.cfg.num_experts_per_tok, dim=-1)  # [T, k]
        if self.cfg.norm_topk_prob:
            top_w /= top_w.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            top_w = top_w.to(logits.dtype)
        lora = ctx.lora
        return ExpertBatch.route(top_i, top_w, lora.token_slots if lora.any_lora else None, self.cfg.num_experts,
                                 self.gate_up_lora.a.shape[1], lora.rank_bound)

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, H] (normed) -> the block's output [T, H], a new tensor."""
        batch = self.route(x, ctx)
        xs = x.index_select(0, batch.tokens)  # [P, H]
        gate, up = self.gate_and_up(xs, batch, ctx)
        down = self._experts(F.silu(gate) * up, self.down, self.down_lora, batch, ctx)  # [P, H]
        weighted = (down * batch.weights[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, batch.tokens, weighted)

    def gate_and_up(self, xs: torch.Tensor, batch: ExpertBatch, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' gate and up projections, [P, I] each (with their LoRA)."""
        inter = self.cfg.moe_intermediate_size
        return self._experts(xs, self.gate_up, self.gate_up_lora, batch, ctx).split([inter, inter], dim=-1)

    @staticmethod
    def _experts(xs: torch.Tensor, weight: torch.Tensor, lora: ExpertLoraBuffers, batch: ExpertBatch,
                 ctx) -> torch.Tensor:
        """Each pair's rows of xs [P, in] through its expert's weight [E, out, in] and LoRA: [P, out]."""
        out = xs.new_empty(batch.num_pairs, weight.shape[1])
        bounds = batch.expert_bounds
        for e in range(weight.shape[0]):
            if bounds[e + 1] > bounds[e]:
                torch.mm(xs[bounds[e]: bounds[e + 1]], weight[e].t(), out=out[bounds[e]: bounds[e + 1]])
        if ctx.lora.any_lora:
            ctx.ops.lora.apply_experts(xs, lora.a, lora.b, lora.scaling, batch, out)
        return out
