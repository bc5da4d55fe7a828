"""Adapters written against transformers 4's per-expert Linear modules of an MoE model.

transformers 4 held each expert as three Linears (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`, gate,
up and down; Qwen3-MoE: `mlp.experts.{e}.gate_proj/up_proj/down_proj`), and PEFT put an ordinary Linear
LoRA on each: W_e' = W_e + scaling * B @ A, scaling alpha / r (rank_pattern / alpha_pattern keyed by those
module names). transformers 5 fuses the experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]), so these
adapters are mapped onto the same per-expert slots PEFT's target_parameters fill (adapters.expert_params):
a gate and an up LoRA of one expert become one gate_up LoRA of rank r_gate + r_up, A stacked and B
block-diagonal (the gate's rows then the up's, as gate_up_proj stacks them). PEFT on transformers 5 converts
such an adapter the same way on load (r and alpha doubled) where it targets both gate and up of every
expert; one targeting some experts, or gate without up, it refuses, and this serves as transformers 4 did.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from adapters.expert_params import expert_projection

# Architecture -> (the MoE block's module, (gate, up, down) names of one expert's Linears)
EXPERT_LINEARS = {"MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
                  "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
ROLES = ("gate", "up", "down")

# PEFT's saved keys for them (the `.default` form: an un-stripped state_dict, as adapters.format accepts).
KEY_RE = re.compile(r"base_model\.model\.model\.layers\.(0|[1-9][0-9]*)\.(block_sparse_moe|mlp)\.experts\."
                    r"(0|[1-9][0-9]*)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.lora_(A|B)(?:\.default)?\.weight")


def linear_projection(expert: int, name: str) -> str:
    """The plan's projection name of expert `expert`'s Linear `name` (w1, gate_proj, ...)."""
    return f"experts.{expert}.{name}"


@dataclass(frozen=True)
class ExpertLinear:
    expert: int
    role: str  # one of ROLES


def parse_linear(proj: str, layout: tuple[str, tuple[str, ...]] | None) -> ExpertLinear | None:
    """The expert and role of a linear_projection name under `layout` (an EXPERT_LINEARS value); None for
    any other projection."""
    parts = proj.split(".")
    if layout is None or len(parts) != 3 or parts[0] != "experts" or parts[2] not in layout[1]:
        return None
    return ExpertLinear(int(parts[1]), ROLES[layout[1].index(parts[2])])


def module_name(layout: tuple[str, tuple[str, ...]], layer: int, proj: str) -> str:
    return f"model.layers.{layer}.{layout[0]}.{proj}"


@dataclass(frozen=True)
class LinearLora:
    """One per-expert Linear's LoRA as materialised: a [r, in], b [out, r] float32, its scaling."""
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def to_expert_weights(layer: int, expert: int, parts: Mapping[str, LinearLora], weights_cls) -> dict:
    """An expert's per-Linear LoRAs (role -> LinearLora) as the engine's expert slots hold them:
    {(layer, expert_projection(...)): weights_cls(a, b, scaling)}."""
    out = {}
    if "down" in parts:
        d = parts["down"]
        out[(layer, expert_projection(expert, "down_proj"))] = weights_cls(d.a, d.b, d.scaling)
    halves = [parts.get(role) for role in ("gate", "up")]
    present = [h for h in halves if h is not None]
    if not present:
        return out
    inter = present[0].b.shape[0]
    # One scaling for the stacked pair: theirs where equal, else folded into each B (1.0 left for the slot).
    shared = len({h.scaling for h in present}) == 1
    scaling = present[0].scaling if shared else 1.0
    a = torch.cat([h.a for h in present])
    b = torch.zeros(2 * inter, a.shape[0], dtype=torch.float32)
    col = 0
    for i, h in enumerate(halves):
        if h is not None:
            r = h.a.shape[0]
            b[i * inter: (i + 1) * inter, col: col + r] = h.b if shared else h.b * h.scaling
            col += r
    out[(layer, expert_projection(expert, "gate_up_proj"))] = weights_cls(a.contiguous(), b, scaling)
    return out
