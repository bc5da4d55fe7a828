"""LoRA on embed_tokens and lm_head, and full copies of them (modules_to_save), as PEFT (0.21) saves them.

PEFT's semantics (peft.tuners.lora.layer.Embedding and Linear, peft.utils.other.ModulesToSaveWrapper):
- LoRA on embed_tokens: lora_embedding_A [r, V], lora_embedding_B [H, r]; token t's embedding gains
  scaling * B @ A[:, t] (no dropout on an embedding), times the model's embedding scale where it has one.
- LoRA on lm_head: lora_A [r, H], lora_B [V, r]; the logits gain scaling * (h A^T) B^T.
- With LoRA on either, PEFT's save (save_embedding_layers="auto") also writes the module's base weight
  (`....base_layer.weight`), and PEFT's load writes it back into the model: it is served as that
  adapter's own copy of the module (the engine keeps none where it equals the base's).
- modules_to_save: a full copy of each module per adapter (`...embed_tokens.weight`, `...lm_head.weight`);
  an entry selects every module whose name ends with it (peft.utils.other._set_trainable); only
  embed_tokens and lm_head are served, anything else (a norm, an MLP) is refused naming it.
- On a tied base (tie_word_embeddings) each part changes its own module only: PEFT wraps the module, not
  the shared weight.

Every part has the base's vocabulary (its config's vocab_size, padding rows included): adapters are
served with the base's tokenizer and an upload carries no tokenizer of its own, so rows beyond the base's
could never be read from a prompt or written as text. An adapter whose tokenizer gained tokens is served
when they fit the base's rows (Llama 3's reserved tokens, a padded vocab_size); a resized one is refused.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch

from adapters.peft_config import MAX_PATTERN_CHARS, AdapterFormatError
from adapters.value_checks import FP16_MAX, check_scaling, check_weights

EMBED, LM_HEAD = "model.embed_tokens", "lm_head"
VOCAB_MODULES = (EMBED, LM_HEAD)
_KEY_RE = re.compile(
    r"base_model\.model\.(model\.embed_tokens|lm_head)\."
    r"(?:lora_embedding_(A|B)(?:\.default)?|lora_(A|B)(?:\.default)?\.weight|(base_layer\.)?weight"
    r"|(modules_to_save|original_module)(?:\.default)?\.weight)")


def is_vocab_key(key: str) -> bool:
    """Whether a tensor key is one of embed_tokens' or lm_head's (this module's, not adapters.format's)."""
    return _KEY_RE.fullmatch(key) is not None


@dataclass(frozen=True, eq=False)
class VocabLora:
    a: torch.Tensor  # embed_tokens: [r, V]; lm_head: [r, H]
    b: torch.Tensor  # embed_tokens: [H, r]; lm_head: [V, r]
    scaling: float


@dataclass(frozen=True, eq=False)
class VocabWeights:
    """One adapter's parts of embed_tokens and lm_head; None where it has none."""

    embed_lora: VocabLora | None = None
    lm_head_lora: VocabLora | None = None
    embed: torch.Tensor | None = None  # [V, H]: its own embedding (modules_to_save, or PEFT's saved base_layer)
    lm_head: torch.Tensor | None = None  # [V, H]: its own lm_head, likewise

    def tensors(self) -> list[torch.Tensor]:
        loras = [t for lora in (self.embed_lora, self.lm_head_lora) if lora is not None for t in (lora.a, lora.b)]
        return loras + [t for t in (self.embed, self.lm_head) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def cast(self, dtype: torch.dtype, pin: bool) -> "VocabWeights":
        """A copy in `dtype` (the host tier's serving dtype), page-locked if `pin`."""
        def to(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = t.to(dtype, copy=True).contiguous()
            return out.pin_memory() if pin else out

        def lora(part: VocabLora | None) -> VocabLora | None:
            return None if part is None else VocabLora(to(part.a), to(part.b), part.scaling)

        return replace(self, embed_lora=lora(self.embed_lora), lm_head_lora=lora(self.lm_head_lora),
                       embed=to(self.embed), lm_head=to(self.lm_head))


@dataclass(frozen=True)
class _LoraPlan:
    a_key: str
    b_key: str
    rank: int
    scaling: float


@dataclass(frozen=True)
class VocabPlan:
    """What the header and config say of the parts, before any tensor exists."""

    loras: Mapping[str, _LoraPlan]  # module (EMBED or LM_HEAD) -> its LoRA
    copies: Mapping[str, str]       # module -> the key of its full copy
    size_bytes: int                 # as float32

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.loras.values())


def modules_to_save_problem(cfg: Mapping[str, Any], module_names: Sequence[str]) -> str | None:
    """Why the config's modules_to_save cannot be served, or None. module_names: the model's modules (PEFT
    matches each entry as a suffix of every one)."""
    entries = cfg.get("modules_to_save")
    if entries is None:
        return None
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        return "modules_to_save must be a list of module names"
    for entry in entries:
        if len(entry) > MAX_PATTERN_CHARS:
            return f"modules_to_save entry {entry[:40]!r}... is longer than {MAX_PATTERN_CHARS} characters"
        matched = [name for name in module_names if name.endswith(entry)]
        other = [name for name in matched if name not in VOCAB_MODULES]
        if other:
            return (f"modules_to_save entry {entry!r} selects {other[0]}: only embed_tokens and lm_head are "
                    "served as saved modules")
        if not matched:
            return f"modules_to_save entry {entry!r} matches no module of the model"
    return None


def saved_modules(cfg: Mapping[str, Any]) -> frozenset[str]:
    """The modules (EMBED, LM_HEAD) the config's modules_to_save selects, checked first."""
    return frozenset(m for m in VOCAB_MODULES for e in cfg.get("modules_to_save") or () if m.endswith(e))


def plan_vocab(cfg: Mapping[str, Any], keys: Sequence[str], shapes: Callable[[str], tuple[tuple[int, ...], str]],
               targets: Mapping[str, tuple[int, float]], vocab_size: int | None, hidden_size: int,
               max_lora_rank: int, max_bytes: int | None, source: str, config_source: str) -> VocabPlan | None:
    """Check the vocabulary parts' tensors (`keys`, each is_vocab_key; shapes(key) -> (shape, dtype)) against
    the config (`targets`: the LoRA-targeted ones of VOCAB_MODULES -> (r, alpha); its modules_to_save) and
    the base. None when the adapter has none."""
    saved = saved_modules(cfg)
    if not keys and not targets and not saved:
        return None
    if cfg.get("use_dora") and targets:
        raise AdapterFormatError(f"{config_source}: use_dora with LoRA on {', '.join(targets)} is not served "
                                 "(DoRA is served on the decoder's projections)", param="use_dora")
    if cfg.get("alora_invocation_tokens") is not None:
        raise AdapterFormatError(f"{config_source}: an activated LoRA (alora_invocation_tokens) with parts of "
                                 "embed_tokens or lm_head is not served", param="alora_invocation_tokens")
    if vocab_size is None:
        raise AdapterFormatError(f"{source}: the base model's config has no vocab_size, so parts of "
                                 "embed_tokens or lm_head cannot be checked")
    found: dict[tuple[str, str], str] = {}
    for key in keys:
        module, emb_ab, lin_ab, base_layer, wrapper = _KEY_RE.fullmatch(key).groups()
        shape, dtype = shapes(key)
        if dtype not in ("F32", "F16", "BF16", "F64"):
            raise AdapterFormatError(f"{source}: tensor {key!r} has dtype {dtype}; need a float dtype")
        if len(shape) != 2:
            raise AdapterFormatError(f"{source}: tensor {key!r} has shape {list(shape)}; need 2 dimensions")
        # Which dimension holds the vocabulary: A's columns for the embedding, B's rows for lm_head, a copy's rows.
        vocab_dim = 1 if emb_ab == "A" else None if emb_ab or lin_ab == "A" else 0
        if vocab_dim is not None and len(shape) == 2 and shape[vocab_dim] != vocab_size:
            raise AdapterFormatError(
                f"{source}: tensor {key!r} has a vocabulary of {shape[vocab_dim]} rows but the base model's is "
                f"{vocab_size}: a resized vocabulary is not served (adapters are served with the base's tokenizer, "
                "and an upload carries none); fit added tokens into the base's vocabulary rows")
        if wrapper:
            raise AdapterFormatError(f"{source}: unexpected tensor key {key!r}")
        part = "A" if (emb_ab or lin_ab) == "A" else "B" if (emb_ab or lin_ab) == "B" else (
            "base" if base_layer else "saved")
        if (module == EMBED) != (emb_ab is not None) and part in "AB":
            raise AdapterFormatError(f"{source}: unexpected tensor key {key!r}: {module} is not an "
                                     f"{'embedding' if emb_ab else 'Linear'}")
        if (module, part) in found:
            raise AdapterFormatError(f"{source}: duplicate tensors {found[module, part]!r} and {key!r}")
        found[module, part] = key

    loras: dict[str, _LoraPlan] = {}
    copies: dict[str, str] = {}
    for module in VOCAB_MODULES:
        a, b = found.get((module, "A")), found.get((module, "B"))
        base, full = found.get((module, "base")), found.get((module, "saved"))
        if module in targets:
            if a is None or b is None:
                raise AdapterFormatError(f"{source}: missing tensors: {module} is targeted but has no "
                                         f"lora_{'A' if a is None else 'B'}")
            rank, alpha = targets[module]
            a_in = vocab_size if module == EMBED else hidden_size
            b_out = hidden_size if module == EMBED else vocab_size
            if shapes(a)[0] != (rank, a_in) or shapes(b)[0] != (b_out, rank):
                raise AdapterFormatError(
                    f"{source}: {module}: lora_A {list(shapes(a)[0])} must be [{rank}, {a_in}] and lora_B "
                    f"{list(shapes(b)[0])} must be [{b_out}, {rank}] (r={rank}, vocab {vocab_size}, hidden "
                    f"{hidden_size})")
            if rank > max_lora_rank:
                raise AdapterFormatError(f"{source}: {module} has rank {rank}, above max_lora_rank {max_lora_rank}")
            scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
            check_scaling(module, scaling, alpha, rank, bool(cfg.get("use_rslora")), config_source)
            loras[module] = _LoraPlan(a, b, rank, scaling)
        elif a is not None or b is not None or base is not None:
            raise AdapterFormatError(f"{source}: tensors for {module}, which adapter_config.json does not target")
        if module in saved and module in targets:
            raise AdapterFormatError(f"{config_source}: {module} is both in target_modules and in modules_to_save",
                                     param="modules_to_save")
        if module in saved and full is None:
            raise AdapterFormatError(f"{source}: missing tensor: {module} is in modules_to_save but has no weight")
        if full is not None and module not in saved:
            raise AdapterFormatError(f"{source}: a full {module} weight, which modules_to_save does not name")
        copy = full or base
        if copy is not None:
            if shapes(copy)[0] != (vocab_size, hidden_size):
                raise AdapterFormatError(f"{source}: tensor {copy!r} has shape {list(shapes(copy)[0])}, must be "
                                         f"[{vocab_size}, {hidden_size}]")
            copies[module] = copy
    size = 4 * (sum(math.prod(shapes(k)[0]) for p in loras.values() for k in (p.a_key, p.b_key))
                + len(copies) * vocab_size * hidden_size)
    if max_bytes is not None and size > max_bytes:
        raise AdapterFormatError(
            f"{source}: the parts of {' and '.join(sorted({*loras, *copies}))} take {size} bytes (as float32), "
            f"above this server's bound of {max_bytes} (--max-lora-vocab-bytes)")
    return VocabPlan(MappingProxyType(loras), MappingProxyType(copies), size)


def materialise_vocab(plan: VocabPlan, get: Callable[[str], torch.Tensor], source: str) -> VocabWeights:
    """The parts as float32, value-checked as every adapter weight is (adapters.value_checks)."""
    def load(key: str) -> torch.Tensor:
        return get(key).to(torch.float32, copy=True).contiguous()

    loras: dict[str, VocabLora] = {}
    for module, p in plan.loras.items():
        a, b = load(p.a_key), load(p.b_key)
        check_weights(module, a, b, p.scaling, source)
        loras[module] = VocabLora(a, b, p.scaling)
    copies: dict[str, torch.Tensor] = {}
    for module, key in plan.copies.items():
        weight = load(key)
        bad = ~torch.isfinite(weight) | (weight.abs() > FP16_MAX)
        if bad.any():
            raise AdapterFormatError(f"{source}: {module}: {key!r} holds {weight[bad][0].item()!r}; every weight "
                                     f"must be finite and within {FP16_MAX:g}")
        copies[module] = weight
    return VocabWeights(loras.get(EMBED), loras.get(LM_HEAD), copies.get(EMBED), copies.get(LM_HEAD))


def to_wire(vocab: VocabWeights | None) -> tuple[list[list], list[torch.Tensor]]:
    """The parts as JSON entries [part, shape, B's shape, scaling] and their tensors, in order (the loader
    process's reply, adapters.loader_worker); from_wire reverses it."""
    entries: list[list] = []
    tensors: list[torch.Tensor] = []
    for name in ("embed_lora", "lm_head_lora", "embed", "lm_head"):
        part = None if vocab is None else getattr(vocab, name)
        if isinstance(part, VocabLora):
            entries.append([name, list(part.a.shape), list(part.b.shape), part.scaling])
            tensors += [part.a, part.b]
        elif part is not None:
            entries.append([name, list(part.shape), [], 0.0])
            tensors.append(part)
    return entries, tensors


def from_wire(entries: list[list], take: Callable[..., torch.Tensor]) -> VocabWeights | None:
    """to_wire's entries back into parts; take(*shape) gives the next tensor. ValueError on a malformed entry."""
    parts: dict[str, Any] = {}
    for name, shape, b_shape, scaling in entries:
        if name in ("embed_lora", "lm_head_lora"):
            parts[name] = VocabLora(take(*shape), take(*b_shape), float(scaling))
        elif name in ("embed", "lm_head"):
            parts[name] = take(*shape)
        else:
            raise ValueError(f"unknown vocabulary part {name!r}")
    return VocabWeights(**parts) if parts else None
