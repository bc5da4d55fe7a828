"""PEFT LoRA adapters: parse, validate against the base model, load as float32.

Semantics follow the installed PEFT (0.21) exactly: which modules a config
targets (`check_target_module_exists`), per-module rank/alpha overrides
(`get_pattern_key`: the first key, in the saved JSON's order, whose regex
`(.*\\.)?(key)$` matches the module name), and scaling `alpha / r` or
`alpha / sqrt(r)` (rslora), and DoRA's magnitude vectors (`use_dora`; the
engine turns them into per-output scales against its base weights,
server.engine.lora.dora_scales). Anything loraplex could not reproduce exactly is
refused with an AdapterFormatError that says why. Everything that bounds
memory (ranks, shapes, byte ranges, total size) is checked from the
safetensors header before a single tensor is materialised; the config's
patterns are resolved under a deadline (adapters.pattern_resolver), and every
materialised weight is value-checked (adapters.value_checks), on upload and on
every later load alike.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import safetensors
import safetensors.torch
import torch

# PROJECTIONS and AdapterFormatError stay importable from here: callers use adapters.format.
from adapters import expert_linears
from adapters.activation import FIELD as INVOCATION_FIELD, invocation_vocab_problem
from adapters.expert_params import (
    EXPERT_WEIGHTS, dense_layers, expert_param_name, expert_projection, targeted_expert_weights, weight_at_depth)
from adapters.medusa_format import HeadWeights, MedusaHeadsError, read_adapter_heads
from adapters.pattern_resolver import resolve_modules
from adapters.peft_config import (
    FUSED_MODULES, FUSED_PROJECTIONS, PROJECTIONS, AdapterFormatError, _parse_config, _positive_int)
from adapters.safetensors_header import (
    SafetensorsHeader, SafetensorsHeaderError, header_from_bytes, header_from_file)
from adapters.value_checks import check_config_alphas, check_magnitude, check_scaling, check_weights
from adapters.vocab_format import (
    VOCAB_MODULES, VocabPlan, VocabWeights, is_vocab_key, materialise_vocab, modules_to_save_problem, plan_vocab)

_ATTENTION = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"))
# Architectures whose checkpoints (and so PEFT's module names) fuse q/k/v and gate/up.
FUSED_PROJECTION_ARCHS = ("Phi3ForCausalLM",)
# Every module name an adapter tensor may carry, in the order modules are planned.
_EXPERT_PROJECTIONS = tuple(f"experts.{w}" for w in EXPERT_WEIGHTS)
_ORDER = {proj: i for i, proj in enumerate(dict.fromkeys(PROJECTIONS + FUSED_PROJECTIONS + _EXPERT_PROJECTIONS))}
# An MoE model's Linear modules: attention only (its experts are parameters, adapters/expert_params).
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1024 * 1024

_FLOAT_DTYPES = frozenset(("F32", "F16", "BF16", "F64"))
# What PEFT's save_pretrained writes (`...lora_A.weight`, and for DoRA `...lora_magnitude_vector`, without
# `.weight`); the `.default` forms are un-stripped PEFT state_dict keys, accepted as aliases of the same tensors.
_KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9][0-9]*)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj)\."
    r"(?:lora_(A|B)(?:\.default)?\.weight|lora_(magnitude)_vector(?:\.default\.weight)?)")
# PEFT's target_parameters LoRA on a layer's fused experts: nested wrappers add `base_layer.`s.
_EXPERT_KEY_RE = re.compile(r"base_model\.model\.model\.layers\.(0|[1-9][0-9]*)\.mlp\.experts\."
                            r"((?:base_layer\.)*)lora_(A|B)(?:\.default)?\.weight")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions an adapter must fit, from the base model's config."""
    num_layers: int
    hidden_size: int
    q_size: int              # num_heads * head_dim
    kv_size: int             # num_kv_heads * head_dim
    intermediate_size: int
    vocab_size: int | None = None  # bounds an aLoRA's invocation token ids; None: not checked
    fused_projections: bool = False  # PEFT sees qkv_proj and gate_up_proj (FUSED_PROJECTION_ARCHS)
    num_experts: int = 0  # an MoE model's experts per layer (0: dense), adapted by target_parameters
    moe_intermediate_size: int = 0  # one expert's intermediate width
    # The server's bound on an adapter's parts of embed_tokens and lm_head, in float32 bytes
    # (--max-lora-vocab-bytes; adapters.vocab_format); None: two full copies of the base's are the most.
    max_vocab_bytes: int | None = None
    # An MoE architecture's per-expert Linear names in transformers 4 (adapters.expert_linears.EXPERT_LINEARS)
    expert_linears: tuple[str, tuple[str, ...]] | None = None
    dense_layers: tuple[int, ...] = ()  # an MoE model's layers with a dense MLP (Qwen3-MoE's), no experts

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "q_size", "kv_size", "intermediate_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"ModelShape.{name} must be a positive int, got {getattr(self, name)!r}")
        if not (self.vocab_size is None or _positive_int(self.vocab_size)):
            raise ValueError(f"ModelShape.vocab_size must be a positive int or None, got {self.vocab_size!r}")
        if not (self.max_vocab_bytes is None or isinstance(self.max_vocab_bytes, int) and self.max_vocab_bytes >= 0):
            raise ValueError(f"ModelShape.max_vocab_bytes must be an int >= 0 or None, got {self.max_vocab_bytes!r}")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelShape":
        """From a decoder's `config.json` dict (the architectures server.engine.config serves)."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        arch = (cfg.get("architectures") or [None])[0]
        experts = (cfg.get("num_local_experts", 8) if arch == "MixtralForCausalLM" else
                   cfg.get("num_experts") or cfg.get("num_local_experts") or 0 if arch == "Qwen3MoeForCausalLM" else 0)
        return cls(cfg["num_hidden_layers"], cfg["hidden_size"], heads * head_dim,
                   kv_heads * head_dim, cfg["intermediate_size"], cfg.get("vocab_size"), arch in FUSED_PROJECTION_ARCHS,
                   experts, cfg.get("moe_intermediate_size") or cfg["intermediate_size"] if experts else 0,
                   expert_linears=expert_linears.EXPERT_LINEARS.get(arch),
                   dense_layers=dense_layers(cfg, cfg["num_hidden_layers"]) if arch == "Qwen3MoeForCausalLM" else ())

    @property
    def projections(self) -> tuple[str, ...]:
        """The Linear modules of a layer as PEFT names them."""
        if self.num_experts:
            return _ATTENTION_PROJECTIONS
        return FUSED_PROJECTIONS if self.fused_projections else PROJECTIONS

    def layer_projections(self, layer: int) -> tuple[str, ...]:
        """The Linear modules of layer `layer`: a dense layer of an MoE model has the dense MLP's too."""
        return PROJECTIONS if layer in self.dense_layers else self.projections

    def experts_of(self, proj: str) -> int:
        """How many experts module `proj` stacks (its LoRA rank is that times r); 1 for a Linear."""
        return self.num_experts if proj in _EXPERT_PROJECTIONS else 1

    def parts(self, proj: str) -> tuple[tuple[str, int, int], ...]:
        """(projection, first row, end row) of module `proj`'s output that each engine projection
        takes: a fused module's lora_B rows split into the projections it fuses."""
        if proj not in FUSED_MODULES or self.num_experts:  # an expert weight is split per expert, not by rows
            return ((proj, 0, self.in_out(proj)[1]),)
        out, start = [], 0
        for part in FUSED_MODULES[proj]:
            width = self.in_out(part)[1]
            out.append((part, start, start + width))
            start += width
        return tuple(out)

    def module_names(self) -> list[str]:
        """The model's module names as PEFT's modules_to_save matching sees them (a Llama-family decoder)."""
        names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}"
            names += [p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn", f"{p}.input_layernorm",
                      f"{p}.post_attention_layernorm"]
            names += [module_name(layer, proj) for proj in self.projections]
        return names

    def in_out(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of the base model's Linear `proj`."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        table = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
                 "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}
        if self.num_experts:  # one expert's share of each fused expert weight
            mi = self.moe_intermediate_size
            table |= {"experts.gate_up_proj": (h, 2 * mi), "experts.down_proj": (mi, h)}
            if (linear := expert_linears.parse_linear(proj, self.expert_linears)) is not None:
                return (mi, h) if linear.role == "down" else (h, mi)
        if proj not in table:
            raise ValueError(f"unknown projection {proj!r}; expected one of {PROJECTIONS + FUSED_PROJECTIONS}")
        return table[proj]


def module_name(layer: int, proj: str) -> str:
    """The module's name inside a *ForCausalLM model, which is what PEFT matches patterns against."""
    return f"model.layers.{layer}.{'self_attn' if proj in _ATTENTION else 'mlp'}.{proj}"


@dataclass(frozen=True, eq=False)
class LoraWeights:
    a: torch.Tensor          # [r, in]  float32, contiguous
    b: torch.Tensor          # [out, r] float32, contiguous
    scaling: float           # alpha / r (or / sqrt(r)), rank/alpha patterns applied
    magnitude: torch.Tensor | None = None  # [out] float32: DoRA's magnitude vector m; None for plain LoRA

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    # max rank over the projections' modules, what a slot holds (0: LoRA on embed_tokens/lm_head only; the
    # public rank, AdapterSummary's, counts those too)
    rank: int
    target_modules: tuple[str, ...]                  # sorted: the modules targeted, as PEFT names them
    use_rslora: bool
    weights: Mapping[tuple[int, str], LoraWeights]   # (layer, one of PROJECTIONS) -> weights; fused ones split
    size_bytes: int                                  # A, B (and DoRA magnitudes) as float32, its medusa heads and draft LoRA
    config: Mapping[str, Any]                        # the parsed adapter_config.json
    # Its parts of embed_tokens and lm_head (counted in size_bytes); keyword-only, so subclasses add fields.
    vocab: VocabWeights | None = field(default=None, kw_only=True)
    # Its own Medusa heads (a `medusa/` folder, adapters.medusa_format): its requests draft with them when
    # the server runs speculative method medusa; None: the base model's heads.
    medusa: HeadWeights | None = field(default=None, kw_only=True)
    # Its own LoRA for the server's draft model (a `draft/` folder, adapters.draft_lora): its requests' drafts
    # run with it when the server runs speculative method draft_model; None: the base draft model.
    draft: LoraAdapter | None = field(default=None, kw_only=True)

    @property
    def use_dora(self) -> bool:
        return any(w.magnitude is not None for w in self.weights.values())


@dataclass(frozen=True)
class AdapterSummary:
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    # The same adapter's config with every user regex resolved away (see
    # adapters.pattern_resolver): store these bytes, not the upload's, so a
    # later load never runs the user's patterns again.
    canonical_config_json: bytes


@dataclass(frozen=True)
class _Module:
    name: str
    rank: int
    in_features: int
    out_features: int
    scaling: float
    a_key: str
    b_key: str
    m_key: str | None        # DoRA's magnitude vector; None for plain LoRA
    parts: tuple[tuple[str, int, int], ...]  # ModelShape.parts: the engine projections it feeds
    experts: int = 1         # a fused expert weight's experts: A [E * r, in], B [out, E * r], split per expert


@dataclass(frozen=True)
class _Plan:
    """Everything known from config and header, before any tensor exists."""
    modules: Mapping[tuple[int, str], _Module]
    use_rslora: bool
    config: Mapping[str, Any]
    summary: AdapterSummary
    vocab: VocabPlan | None
    linear_layout: tuple[str, tuple[str, ...]] | None = None  # ModelShape.expert_linears


# ---- public entry points -------------------------------------------------

def load_adapter_dir(path: str | os.PathLike, shape: ModelShape, max_lora_rank: int, *,
                     max_bytes: int | None = None) -> LoraAdapter:
    """Load a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise AdapterFormatError(f"{root}: not a directory")
    config_path = os.path.join(root, CONFIG_FILE)
    weights_path = os.path.join(root, WEIGHTS_FILE)
    if not os.path.isfile(config_path):
        raise AdapterFormatError(f"{root}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    if not os.path.isfile(weights_path):
        if os.path.exists(os.path.join(root, PICKLE_FILE)):
            raise AdapterFormatError(
                f"{root}: only {PICKLE_FILE} found; pickle .bin files are not loaded, "
                f"save with safe_serialization=True to get {WEIGHTS_FILE}")
        raise AdapterFormatError(f"{root}: no {WEIGHTS_FILE}")
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{config_path}: larger than {MAX_CONFIG_BYTES} bytes")
    with open(config_path, "rb") as f:
        config = _parse_config(f.read(), config_path)
    try:
        header = header_from_file(weights_path)
    except SafetensorsHeaderError as e:
        raise AdapterFormatError(f"{weights_path}: corrupt safetensors file: {e}") from None
    plan = _plan(config, header, shape, max_lora_rank, max_bytes, weights_path)
    heads = _adapter_heads(root, shape)
    try:
        with safetensors.safe_open(weights_path, framework="pt", device="cpu") as f:
            adapter = _materialise(plan, f.get_tensor, weights_path)
    except safetensors.SafetensorError as e:
        raise AdapterFormatError(f"{weights_path}: corrupt safetensors file: {e}") from None
    return adapter if heads is None else with_heads(adapter, heads)


def with_heads(adapter: LoraAdapter, heads: HeadWeights) -> LoraAdapter:
    """`adapter` carrying its own Medusa heads, their bytes counted in its size_bytes (the host tier's budget)."""
    return dataclasses.replace(adapter, medusa=heads, size_bytes=adapter.size_bytes + heads.nbytes)


def _adapter_heads(root: str, shape: ModelShape) -> HeadWeights | None:
    """The directory's own Medusa heads (its `medusa/` folder), checked against the base; None without."""
    if shape.vocab_size is None and os.path.exists(os.path.join(root, "medusa")):
        raise AdapterFormatError(f"{root}: medusa heads need the base model's vocab_size, which is not known here")
    try:
        return read_adapter_heads(root, shape.hidden_size, shape.vocab_size or 0)
    except MedusaHeadsError as e:
        raise AdapterFormatError(f"{root}: {e}") from None


def load_adapter_bytes(config_json: bytes, weights: bytes, shape: ModelShape, max_lora_rank: int, *,
                       max_bytes: int | None = None) -> LoraAdapter:
    """Load an uploaded adapter from the two files' contents."""
    plan = _plan_bytes(config_json, weights, shape, max_lora_rank, max_bytes)
    try:
        tensors = safetensors.torch.load(bytes(weights))
    except safetensors.SafetensorError as e:
        raise AdapterFormatError(f"{WEIGHTS_FILE}: corrupt safetensors file: {e}") from None
    return _materialise(plan, tensors.__getitem__, WEIGHTS_FILE)


def inspect_adapter_bytes(config_json: bytes, weights: bytes, shape: ModelShape, max_lora_rank: int, *,
                          max_bytes: int | None = None) -> AdapterSummary:
    """Full validation of an upload from its config and header; builds no tensors."""
    return _plan_bytes(config_json, weights, shape, max_lora_rank, max_bytes).summary


def _plan_bytes(config_json: bytes, weights: bytes, shape: ModelShape, max_lora_rank: int,
                max_bytes: int | None) -> _Plan:
    if len(config_json) > MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
    config = _parse_config(config_json, CONFIG_FILE)
    try:
        header = header_from_bytes(weights)
    except SafetensorsHeaderError as e:
        raise AdapterFormatError(f"{WEIGHTS_FILE}: corrupt safetensors file: {e}") from None
    return _plan(config, header, shape, max_lora_rank, max_bytes, WEIGHTS_FILE)


# ---- config x header x model: the plan -------------------------------------

def _plan(cfg: Mapping[str, Any], header: SafetensorsHeader, shape: ModelShape, max_lora_rank: int,
          max_bytes: int | None, source: str) -> _Plan:
    """Check every tensor against the config and the base model, from the header alone."""
    if not _positive_int(max_lora_rank):
        raise ValueError(f"max_lora_rank must be a positive int, got {max_lora_rank!r}")
    # Refusals that come from the config alone name the config file next to the weights.
    config_source = os.path.join(os.path.dirname(source), CONFIG_FILE)
    check_config_alphas(cfg, max_lora_rank, config_source)
    if (why := invocation_vocab_problem(cfg, shape.vocab_size)) is not None:
        raise AdapterFormatError(f"{config_source}: {why}", param=INVOCATION_FIELD)
    names = {(layer, proj): module_name(layer, proj) for layer in range(shape.num_layers)
             for proj in _projections(cfg, shape, layer)}
    experts = targeted_expert_weights(cfg, shape.num_layers, shape.num_experts, config_source, shape.dense_layers)
    params = {(layer, f"experts.{w}"): expert_param_name(layer, w) for layer, hit in experts.items() for w in hit}
    linears = _expert_linear_names(header, shape)
    if linears and experts:
        raise AdapterFormatError(f"{config_source}: target_parameters together with per-expert Linear LoRA "
                                 "(transformers 4's experts.{e} modules) is not supported", "target_parameters")
    if linears and cfg.get("use_dora", False):
        raise AdapterFormatError(f"{config_source}: use_dora on per-expert Linear modules (DoRA on MoE experts) "
                                 "is not supported", "use_dora")
    names |= linears
    resolved = resolve_modules(cfg, list(names.values()), config_source, parameters=list(params.values()))
    if len(resolved.canonical_json) > MAX_CONFIG_BYTES:  # what is stored must load again: refused now, not then
        raise AdapterFormatError(f"{config_source}: the config's {len(resolved.ranks)} targeted modules, listed by "
                                 f"name as stored, are over {MAX_CONFIG_BYTES} bytes", "target_modules")
    names |= params
    expected = {slot for slot, name in names.items() if name in resolved.ranks}

    if (why := modules_to_save_problem(cfg, shape.module_names())) is not None:
        raise AdapterFormatError(f"{config_source}: {why}", param="modules_to_save")
    vocab_keys = [k for k in header.tensors if is_vocab_key(k)]
    info = header.tensors
    vocab = plan_vocab(cfg, vocab_keys, lambda k: (info[k].shape, info[k].dtype),
                       {m: (resolved.ranks[m], resolved.alphas[m]) for m in VOCAB_MODULES if m in resolved.ranks},
                       shape.vocab_size, shape.hidden_size, max_lora_rank, shape.max_vocab_bytes, source,
                       config_source)
    keys = _tensor_keys(header, shape, max_lora_rank, source, experts)
    use_rslora = cfg.get("use_rslora", False)
    use_dora = cfg.get("use_dora", False)
    modules: dict[tuple[int, str], _Module] = {}
    position = {slot: i for i, slot in enumerate(names)}
    for slot in sorted(set(keys) | expected, key=lambda s: (s[0], _ORDER.get(s[1], len(_ORDER)), position.get(s, 0))):
        name = names.get(slot, module_name(*slot))
        if slot not in expected:
            raise AdapterFormatError(f"{source}: tensors for {name}, which adapter_config.json does not target")
        ab = keys.get(slot, {})
        if not ab:
            raise AdapterFormatError(f"{source}: missing tensors: {name} is targeted but has no lora_A/lora_B")
        for part in "AB":
            if part not in ab:
                other = "B" if part == "A" else "A"
                raise AdapterFormatError(f"{source}: missing tensor: {name} has lora_{other} but no lora_{part}")
        if use_dora and "M" not in ab:
            raise AdapterFormatError(f"{source}: missing tensor: {name} has no lora_magnitude_vector, which "
                                     "use_dora=true needs for every targeted module")
        if "M" in ab and not use_dora:
            raise AdapterFormatError(f"{source}: {name} has a lora_magnitude_vector (DoRA) but adapter_config.json "
                                     "does not set use_dora=true")
        rank, module_alpha = resolved.ranks[name], resolved.alphas[name]
        in_f, out_f = shape.in_out(slot[1])
        n_exp = shape.experts_of(slot[1])
        a_shape, b_shape = header.tensors[ab["A"]].shape, header.tensors[ab["B"]].shape
        if n_exp > 1:  # checked as one expert's share: [r, in] and [out, r]
            if a_shape[0] != n_exp * rank or b_shape[1] != n_exp * rank:
                raise AdapterFormatError(
                    f"{source}: {name}: tensors have {a_shape[0]}/{b_shape[1]} rows/columns (lora_A/lora_B) but "
                    f"{n_exp} experts at r={rank} (r, rank_pattern) need {n_exp * rank}")
            a_shape, b_shape = (rank, a_shape[1]), (b_shape[0], rank)
        if a_shape[0] != rank or b_shape[1] != rank:
            raise AdapterFormatError(
                f"{source}: {name}: tensors have rank {a_shape[0]}/{b_shape[1]} (lora_A/lora_B) but "
                f"adapter_config.json gives r={rank} for this module (r, rank_pattern)")
        if a_shape != (rank, in_f) or b_shape != (out_f, rank):
            raise AdapterFormatError(
                f"{source}: {name}: shape mismatch with the base model: lora_A {list(a_shape)} must be "
                f"[{rank}, {in_f}] and lora_B {list(b_shape)} must be [{out_f}, {rank}] (in_features={in_f}, "
                f"out_features={out_f})")
        if "M" in ab and header.tensors[ab["M"]].shape != (out_f,):
            raise AdapterFormatError(
                f"{source}: {name}: lora_magnitude_vector has shape {list(header.tensors[ab['M']].shape)}, must be "
                f"[{out_f}] (out_features)")
        scaling = module_alpha / math.sqrt(rank) if use_rslora else module_alpha / rank
        check_scaling(name, scaling, module_alpha, rank, use_rslora, config_source)
        modules[slot] = _Module(name, rank, in_f, out_f, scaling, ab["A"], ab["B"], ab.get("M"), shape.parts(slot[1]),
                                n_exp)

    rank = _check_stacked_ranks(modules, shape.expert_linears, max_lora_rank, source)
    size = sum(4 * (m.experts * m.rank * (m.in_features + m.out_features) + (m.out_features if m.m_key else 0))
               for m in modules.values()) + (vocab.size_bytes if vocab else 0)
    # A per-expert gate or up LoRA's B fills its half of the expert's gate_up rows, the other half zero.
    size += sum(4 * m.rank * m.out_features for slot, m in modules.items()
                if getattr(expert_linears.parse_linear(slot[1], shape.expert_linears), "role", "down") != "down")
    if max_bytes is not None and size > max_bytes:
        raise AdapterFormatError(f"{source}: adapter size {size} bytes (as float32) is above the limit "
                                 f"of {max_bytes} bytes")
    ranks = [rank] + list(vocab.ranks if vocab else ())
    targeted = {proj for _, proj in modules} | {m.rsplit(".", 1)[-1] for m in (vocab.loras if vocab else ())}
    summary = AdapterSummary(max(ranks), tuple(sorted(targeted)), size, resolved.canonical_json)
    return _Plan(MappingProxyType(modules), use_rslora, cfg, summary, vocab, shape.expert_linears)


def _expert_linear_names(header: SafetensorsHeader, shape: ModelShape) -> dict[tuple[int, str], str]:
    """(layer, projection) -> module name of every per-expert Linear of the model (adapters.expert_linears),
    where the file holds tensors for such modules: an adapter written with transformers 4. Otherwise none,
    so that target_modules="all-linear" means what it means on transformers 5 (attention only)."""
    layout = shape.expert_linears
    if layout is None or not any(_linear_match(k, shape) for k in header.tensors):
        return {}
    projections = [expert_linears.linear_projection(e, n) for e in range(shape.num_experts) for n in layout[1]]
    return {(layer, proj): expert_linears.module_name(layout, layer, proj) for layer in range(shape.num_layers)
            if layer not in shape.dense_layers for proj in projections}


def _linear_match(key: str, shape: ModelShape) -> re.Match | None:
    """key's match as a per-expert Linear's tensor of this model's layout (its block and names)."""
    layout = shape.expert_linears
    found = expert_linears.KEY_RE.fullmatch(key) if layout is not None else None
    return found if found is not None and found[2] == layout[0] and found[4] in layout[1] else None


def _check_stacked_ranks(modules: Mapping[tuple[int, str], _Module], layout, max_lora_rank: int,
                         source: str) -> int:
    """The adapter's rank as the engine's slots hold it: an expert's gate and up Linear LoRAs stack into
    one gate_up LoRA of rank r_gate + r_up (adapters.expert_linears), which must fit max_lora_rank."""
    stacked: dict[tuple[int, int], list[_Module]] = {}
    for (layer, proj), m in modules.items():
        linear = expert_linears.parse_linear(proj, layout)
        if linear is not None and linear.role != "down":
            stacked.setdefault((layer, linear.expert), []).append(m)
    for pair in stacked.values():
        if sum(m.rank for m in pair) > max_lora_rank:
            raise AdapterFormatError(
                f"{source}: {' and '.join(m.name for m in pair)}: ranks {' + '.join(str(m.rank) for m in pair)} "
                f"stack into one gate_up LoRA of the expert, above max_lora_rank {max_lora_rank}")
    return max([m.rank for m in modules.values()] + [sum(m.rank for m in pair) for pair in stacked.values()],
               default=0)  # 0: parts of embed_tokens/lm_head only (adapters.vocab_format)


def _projections(cfg: Mapping[str, Any], shape: ModelShape, layer: int) -> tuple[str, ...]:
    """The module names an adapter is matched against: the model's, except that on a fused model an
    adapter listing split names (q_proj, gate_proj, ...: what a converter to the Llama layout writes) is
    matched against those, each feeding its rows of the fused projection."""
    target = cfg.get("target_modules")
    split = set(PROJECTIONS) - set(FUSED_PROJECTIONS)
    if shape.fused_projections and isinstance(target, list) and any(t.rsplit(".", 1)[-1] in split for t in target):
        return PROJECTIONS
    return shape.layer_projections(layer)


def _tensor_keys(header: SafetensorsHeader, shape: ModelShape, max_lora_rank: int, source: str,
                 experts: Mapping[int, tuple[str, ...]]) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, proj) -> {"A": key, "B": key}; per-tensor checks that need no more of the config than
    `experts` (adapters.expert_params.targeted_expert_weights: which saved key is which expert weight).
    Keys of embed_tokens and lm_head parts are adapters.vocab_format's."""
    unexpected = [k for k in header.tensors if not _KEY_RE.fullmatch(k) and not is_vocab_key(k)
                  and not (shape.num_experts and (_EXPERT_KEY_RE.fullmatch(k) or _linear_match(k, shape)))]
    if unexpected:
        shown = ", ".join(repr(k) for k in sorted(unexpected)[:3])
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        raise AdapterFormatError(f"{source}: unexpected tensor keys {shown}{more}; only lora_A/lora_B weights "
                                 f"(and DoRA lora_magnitude_vector) of {', '.join(shape.projections)} are served")
    out: dict[tuple[int, str], dict[str, str]] = {}
    for key, info in header.tensors.items():
        if is_vocab_key(key):  # adapters.vocab_format's
            continue
        per_expert = 1
        if (expert_match := _EXPERT_KEY_RE.fullmatch(key)) is not None:
            layer_s, wrappers, ab = expert_match.groups()
            parent, magnitude, per_expert = "mlp", None, shape.num_experts
            weight = weight_at_depth(experts.get(int(layer_s), ()), wrappers.count("base_layer."))
            if weight is None:
                raise AdapterFormatError(f"{source}: tensor {key!r} is for an expert weight that adapter_config.json's "
                                         "target_parameters does not target", "target_parameters")
            proj = f"experts.{weight}"
        elif (linear_match := _linear_match(key, shape)) is not None:
            layer_s, parent, expert_s, name, ab = linear_match.groups()
            magnitude, parent = None, "mlp"
            if int(expert_s) >= shape.num_experts:
                raise AdapterFormatError(f"{source}: tensor {key!r} is for expert {expert_s} but the base model has "
                                         f"{shape.num_experts} experts per layer")
            proj = expert_linears.linear_projection(int(expert_s), name)
        else:
            layer_s, parent, proj, ab, magnitude = _KEY_RE.fullmatch(key).groups()
        part = ab or "M"
        layer = int(layer_s)
        if (parent == "self_attn") != (proj in _ATTENTION):
            raise AdapterFormatError(f"{source}: unexpected tensor key {key!r}: {proj} is not under {parent}")
        if info.dtype not in _FLOAT_DTYPES:
            raise AdapterFormatError(f"{source}: tensor {key!r} has dtype {info.dtype}; need a float dtype "
                                     f"({', '.join(sorted(_FLOAT_DTYPES))})")
        dims = 1 if magnitude else 2
        if len(info.shape) != dims:
            raise AdapterFormatError(f"{source}: tensor {key!r} has shape {list(info.shape)}; need {dims} "
                                     f"dimension{'s' if dims > 1 else ''}")
        if layer >= shape.num_layers:
            raise AdapterFormatError(f"{source}: tensor {key!r} is for layer {layer} but the base model has "
                                     f"{shape.num_layers} layers")
        if not magnitude:  # a magnitude vector has no rank: its length is checked against the module
            rank = info.shape[0] if part == "A" else info.shape[1]
            if rank % per_expert:
                raise AdapterFormatError(f"{source}: tensor {key!r} has {rank} rank rows, not a multiple of the "
                                         f"model's {per_expert} experts")
            rank //= per_expert
            if rank > max_lora_rank:
                raise AdapterFormatError(f"{source}: tensor {key!r} has rank {rank}, above max_lora_rank "
                                         f"{max_lora_rank}")
            if rank == 0:
                raise AdapterFormatError(f"{source}: tensor {key!r} has rank 0")
        slot = out.setdefault((layer, proj), {})
        if part in slot:
            raise AdapterFormatError(f"{source}: duplicate tensors {slot[part]!r} and {key!r}")
        slot[part] = key
    return out


def _materialise(plan: _Plan, get: Callable[[str], torch.Tensor], source: str) -> LoraAdapter:
    weights: dict[tuple[int, str], LoraWeights] = {}
    linears: dict[tuple[int, int], dict[str, expert_linears.LinearLora]] = {}  # (layer, expert) -> role -> LoRA
    for slot, m in plan.modules.items():
        # copy=True: never alias a memory-mapped file or the caller's buffer.
        a = get(m.a_key).to(torch.float32, copy=True).contiguous()     # a: [r, in]
        b = get(m.b_key).to(torch.float32, copy=True).contiguous()     # b: [out, r]
        if a.shape != (m.experts * m.rank, m.in_features) or b.shape != (m.out_features, m.experts * m.rank):
            raise AdapterFormatError(f"{source}: file changed while loading ({m.a_key!r})")
        check_weights(m.name, a, b, m.scaling, source)
        magnitude = None
        if m.m_key is not None:
            magnitude = get(m.m_key).to(torch.float32, copy=True).contiguous()     # magnitude: [out]
            if magnitude.shape != (m.out_features,):
                raise AdapterFormatError(f"{source}: file changed while loading ({m.m_key!r})")
            check_magnitude(m.name, magnitude, source)
        if (linear := expert_linears.parse_linear(slot[1], plan.linear_layout)) is not None:
            linears.setdefault((slot[0], linear.expert), {})[linear.role] = expert_linears.LinearLora(a, b, m.scaling)
            continue
        if m.experts > 1:  # expert e: A rows e*r.., B columns e::E (adapters.expert_params)
            a_e, b_e = a.view(m.experts, m.rank, m.in_features), b.view(m.out_features, m.rank, m.experts)
            weight = slot[1].removeprefix("experts.")
            for e in range(m.experts):
                weights[(slot[0], expert_projection(e, weight))] = LoraWeights(
                    a_e[e].contiguous(), b_e[:, :, e].contiguous(), m.scaling)
            continue
        # A fused module's delta, row block by row block, is its parts' deltas: x A^T B[lo:hi]^T.
        for proj, lo, hi in m.parts:
            part_b = b if (lo, hi) == (0, m.out_features) else b[lo:hi].contiguous()
            part_m = magnitude if magnitude is None or (lo, hi) == (0, m.out_features) else magnitude[lo:hi].contiguous()
            weights[(slot[0], proj)] = LoraWeights(a, part_b, m.scaling, part_m)
    for (layer, expert), parts in linears.items():
        weights |= expert_linears.to_expert_weights(layer, expert, parts, LoraWeights)
    s = plan.summary
    vocab = None if plan.vocab is None else materialise_vocab(plan.vocab, get, source)
    # The projections' rank as the slots hold it (an expert's gate and up Linear LoRAs stacked: their sum);
    # 0 for parts of embed_tokens/lm_head only.
    rank = max((w.rank for w in weights.values()), default=0)
    return LoraAdapter(rank, s.target_modules, plan.use_rslora, MappingProxyType(weights), s.size_bytes,
                       plan.config, vocab=vocab)
