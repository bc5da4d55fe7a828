"""PEFT's `target_parameters` LoRA on an MoE model's fused expert weights (peft 0.21, ParamWrapper).

transformers 5 holds each layer's experts as two 3-D parameters of `mlp.experts`: gate_up_proj
[E, 2I, H] and down_proj [E, H, I]. PEFT matches a target `t` against `{module}.{param}` (equal, or
ending in `.t`) and wraps each matched parameter in a ParamWrapper; two targets on one module nest, in
the module's parameter order, so the first (gate_up_proj) is saved under one `base_layer.` more than the
second. Its lora_A is [E * r, in] (expert-major rows) and lora_B [out, E * r] (columns rank-major, expert
innermost): expert e's delta is scaling * B[:, e::E] @ A[e*r:(e+1)*r].
"""
from __future__ import annotations

from typing import Any, Mapping

from adapters.pattern_match import dotted_suffixes
from adapters.peft_config import AdapterFormatError

# The experts module's parameters in definition order (the order PEFT nests its wrappers in).
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_projection(expert: int, weight: str) -> str:
    """The projection name an adapter's weights carry for expert `expert`'s share of fused weight `weight`
    (LoraAdapter.weights keys (layer, this)); the engine's expert slots read it back (expert_of)."""
    return f"experts.{expert}.{weight}"


def expert_of(proj: str) -> tuple[int, str] | None:
    """(expert, weight) of an expert_projection name; None for a dense projection."""
    if not proj.startswith("experts."):
        return None
    _, expert, weight = proj.split(".")
    return int(expert), weight


def dense_layers(cfg: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers of a Qwen3-MoE config with a dense MLP in place of experts, as transformers builds them:
    those in `mlp_only_layers`, and those where (layer + 1) is not a multiple of `decoder_sparse_step`."""
    only, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


def expert_param_name(layer: int, weight: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{weight}"


def targeted_expert_weights(cfg: Mapping[str, Any], num_layers: int, num_experts: int,
                            source: str, dense: tuple[int, ...] = ()) -> dict[int, tuple[str, ...]]:
    """layer -> the expert weights cfg's target_parameters names there, in EXPERT_WEIGHTS order (`dense`:
    layers without experts)."""
    targets = cfg.get("target_parameters") or []
    if not targets:
        return {}
    if not num_experts:
        raise AdapterFormatError(f"{source}: target_parameters (LoRA on raw parameters) is served on the experts of "
                                 "a mixture-of-experts model only", "target_parameters")
    for field in ("layers_to_transform", "layers_pattern", "exclude_modules"):
        if cfg.get(field):
            raise AdapterFormatError(f"{source}: {field} with target_parameters is not supported", field)
    wanted = set(targets)  # t matches a name equal to it or ending in "." + t: one of its dotted suffixes
    out = {}
    for layer in (i for i in range(num_layers) if i not in dense):
        names = {w: expert_param_name(layer, w) for w in EXPERT_WEIGHTS}
        hit = tuple(w for w, n in names.items() if not wanted.isdisjoint(dotted_suffixes(n)))
        if hit:
            out[layer] = hit
    if not out:
        raise AdapterFormatError(f"{source}: target_parameters {targets} match no expert weight of the model "
                                 f"(mlp.experts.{' / '.join(EXPERT_WEIGHTS)})", "target_parameters")
    return out


def weight_at_depth(hit: tuple[str, ...], base_layers: int) -> str | None:
    """Which of a layer's targeted weights PEFT saves under `base_layers` nested `base_layer.`s."""
    index = len(hit) - 1 - base_layers
    return hit[index] if 0 <= index < len(hit) else None
