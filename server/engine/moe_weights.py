"""An MoE layer's router and experts from a checkpoint, stacked as transformers 5 holds them.

Hub checkpoints (and transformers 5's save_pretrained, which writes the original layout back) store
one Linear per expert: Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down), Qwen3-MoE's
`mlp.experts.{e}.gate_proj/up_proj/down_proj`. A checkpoint written in transformers 5's fused layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) is taken as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.expert_linears import EXPERT_LINEARS
from server.engine.config import ModelConfig



@dataclass(frozen=True)
class ExpertWeights:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows, as transformers 5's gate_up_proj
    down: torch.Tensor  # [E, H, I]


def expert_keys(cfg: ModelConfig, i: int, present) -> list[str]:
    """The keys layer i's MoE block needs (`present`: the checkpoint's keys, to tell the layouts apart)."""
    block, names = EXPERT_LINEARS[cfg.architecture]
    p = f"model.layers.{i}."
    fused = [p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
    if fused[0] in present:
        return [p + "mlp.gate.weight", *fused]
    return [p + f"{block}.gate.weight"] + [p + f"{block}.experts.{e}.{n}.weight"
                                           for e in range(cfg.num_experts) for n in names]


def take_experts(weights, cfg: ModelConfig, i: int) -> ExpertWeights:
    """Layer i's router and stacked experts, taken out of `weights` (each per-expert tensor freed as stacked)."""
    keys = expert_keys(cfg, i, weights)
    if len(keys) == 3:
        return ExpertWeights(*(weights.pop(k) for k in keys))
    router, per_expert = weights.pop(keys[0]), keys[1:]
    gate_up, down = [], []
    for e in range(cfg.num_experts):
        gate, up, dn = (weights.pop(k) for k in per_expert[3 * e: 3 * e + 3])
        gate_up.append(torch.cat([gate, up]))
        down.append(dn)
    return ExpertWeights(router, torch.stack(gate_up), torch.stack(down))
