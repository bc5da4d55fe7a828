"""Medusa heads' files (speculative method `medusa`; served by server.engine.medusa_heads): K small heads over
the target's last hidden state, head i guessing the token i + 1 places after the one the target chooses there.

Medusa-1's residual block, without a head's own lm_head: head i maps the last layer's output h (before the
final norm) to h + SiLU(W_i h + b_i), and the base model's final norm and lm_head turn that into logits,
so a head file holds K x (H x H + H) numbers and never a vocabulary-wide matrix. The drafts are each
head's top-1, one chain (no tree attention); the target verifies them like any drafts.

A heads directory holds `medusa_config.json` ({"num_heads": K, "hidden_size": H, "vocab_size": V}: the
base model's hidden size and vocabulary they were trained for) and `medusa_heads.safetensors`
(`heads.{i}.weight` [H, H], `heads.{i}.bias` [H], i < K). Whatever does not fit the base model is
refused in one line naming the mismatch (MedusaHeadsError).

The weights file may also hold `draft_vocab` [N] (integer token ids, distinct, most frequent first): the
draft vocabulary (FR-Spec's reduced draft vocabulary). The heads then take their top-1 over those N rows of
the lm_head alone, a copy of N rows in place of the whole vocabulary's (drafts need not be exact, the
target verifies them): scripts/train_medusa_heads writes the ids its answers use most. Without it, the heads
draft over the whole vocabulary.

An adapter may carry heads of its own in a `medusa/` folder beside its PEFT files (the same two files):
its requests draft with them (read_adapter_heads; at most MAX_ADAPTER_HEADS heads, so a tenant's upload
is bounded by the base model's hidden size).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa_heads.safetensors"
_CONFIG_KEYS = ("num_heads", "hidden_size", "vocab_size")
# A config is a few numbers; anything longer is not one.
MAX_CONFIG_BYTES = 1 << 16
ADAPTER_DIR = "medusa"  # an adapter's own heads: this folder beside its PEFT files
MAX_ADAPTER_HEADS = 8  # heads an adapter may carry (Medusa-1 uses 4 or 5)
_SAFETENSORS_HEADER_BYTES = 1 << 16  # a heads file's header, past its tensors' bytes
DRAFT_VOCAB = "draft_vocab"  # the optional tensor of draft vocabulary ids in the weights file


class MedusaHeadsError(ValueError):
    """Heads that do not fit the base model (or are not heads at all): one line naming the mismatch."""


@dataclass(frozen=True)
class MedusaHeadsConfig:
    num_heads: int  # K
    hidden_size: int  # the base model's hidden size they were trained on
    vocab_size: int  # and its vocabulary


@dataclass(frozen=True)
class HeadWeights:
    """Checked head tensors, on the host: weight [K, H, H] (out, in), bias [K, H]; draft_vocab [N] int64
    token ids the heads draft among (None: the whole vocabulary)."""

    weight: torch.Tensor
    bias: torch.Tensor
    draft_vocab: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes + (self.draft_vocab.nbytes if self.draft_vocab is not None else 0)


def parse_config(text: bytes | str) -> MedusaHeadsConfig:
    if len(text) > MAX_CONFIG_BYTES:
        raise MedusaHeadsError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MedusaHeadsError(f"{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise MedusaHeadsError(f"{CONFIG_FILE} must be a JSON object")
    unknown = sorted(set(value) - set(_CONFIG_KEYS))
    if unknown:
        raise MedusaHeadsError(f"{CONFIG_FILE} key {unknown[0]!r} is not supported; supported: {', '.join(_CONFIG_KEYS)}")
    numbers = []
    for key in _CONFIG_KEYS:
        n = value.get(key)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MedusaHeadsError(f"{CONFIG_FILE} {key} must be a positive integer, got {n!r}")
        numbers.append(n)
    return MedusaHeadsConfig(*numbers)


def max_weights_bytes(num_heads: int, hidden_size: int, vocab_size: int) -> int:
    """The most bytes a heads file of `num_heads` heads may take: theirs in float32, a draft vocabulary of
    the whole vocabulary in int64, and a header."""
    return num_heads * (hidden_size * hidden_size + hidden_size) * 4 + vocab_size * 8 + _SAFETENSORS_HEADER_BYTES


def check_heads(config: bytes | str, weights: bytes, hidden_size: int, vocab_size: int,
                min_heads: int = 1, max_heads: int | None = None) -> HeadWeights:
    """The heads in a config's and a safetensors file's bytes, checked against a base model of this hidden
    size and vocabulary, with at least `min_heads` heads (and at most `max_heads`, whose float32 bytes
    bound the weights file before it is parsed)."""
    cfg = parse_config(config)
    if max_heads is not None:
        if cfg.num_heads > max_heads:
            raise MedusaHeadsError(f"medusa heads num_heads {cfg.num_heads} is over the limit of {max_heads}")
        bound = max_weights_bytes(max_heads, hidden_size, vocab_size)
        if len(weights) > bound:
            raise MedusaHeadsError(f"{WEIGHTS_FILE} is {len(weights)} bytes, over the limit of {bound} bytes for "
                                   f"{max_heads} heads of hidden_size {hidden_size}")
    if cfg.hidden_size != hidden_size:
        raise MedusaHeadsError(f"medusa heads hidden_size {cfg.hidden_size} does not match the base model's "
                               f"hidden_size {hidden_size}")
    if cfg.vocab_size != vocab_size:
        raise MedusaHeadsError(f"medusa heads vocab_size {cfg.vocab_size} does not match the base model's "
                               f"vocab_size {vocab_size}")
    if cfg.num_heads < min_heads:
        raise MedusaHeadsError(f"medusa heads num_heads {cfg.num_heads} is fewer than num_speculative_tokens "
                               f"{min_heads}")
    try:
        tensors = load_safetensors(weights)
    except (SafetensorError, ValueError) as e:
        raise MedusaHeadsError(f"{WEIGHTS_FILE} is not a safetensors file: {e}") from None
    expected = {f"heads.{i}.{part}": shape for i in range(cfg.num_heads)
                for part, shape in (("weight", (hidden_size, hidden_size)), ("bias", (hidden_size,)))}
    for name in sorted(tensors):
        if name not in expected and name != DRAFT_VOCAB:
            why = " (a head's own lm_head is not supported: heads share the base model's)" if "lm_head" in name else ""
            raise MedusaHeadsError(f"{WEIGHTS_FILE} tensor {name!r} is not a medusa head tensor{why}")
    for name, shape in expected.items():
        if name not in tensors:
            raise MedusaHeadsError(f"{WEIGHTS_FILE} has no tensor {name!r} (num_heads is {cfg.num_heads})")
        if tuple(tensors[name].shape) != shape:
            raise MedusaHeadsError(f"{WEIGHTS_FILE} tensor {name!r} has shape {list(tensors[name].shape)}, "
                                   f"the base model needs {list(shape)}")
        if not tensors[name].is_floating_point():
            raise MedusaHeadsError(f"{WEIGHTS_FILE} tensor {name!r} is {tensors[name].dtype}, not a float tensor")
    rng = range(cfg.num_heads)
    vocab = tensors.get(DRAFT_VOCAB)
    return HeadWeights(torch.stack([tensors[f"heads.{i}.weight"].float() for i in rng]),
                       torch.stack([tensors[f"heads.{i}.bias"].float() for i in rng]),
                       None if vocab is None else _check_draft_vocab(vocab, vocab_size))


def _check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A weights file's draft vocabulary: 1 to vocab_size distinct token ids of the base's vocabulary."""
    where = f"{WEIGHTS_FILE} tensor {DRAFT_VOCAB!r}"
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise MedusaHeadsError(f"{where} must be 1-D int32 or int64, got {ids.dtype} of shape {list(ids.shape)}")
    if not 1 <= len(ids) <= vocab_size:
        raise MedusaHeadsError(f"{where} has {len(ids)} ids: 1 to the base model's vocab_size {vocab_size}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise MedusaHeadsError(f"{where} holds id {bad}, outside the base model's vocab_size {vocab_size}")
    if len(torch.unique(ids)) != len(ids):
        raise MedusaHeadsError(f"{where} holds an id twice")
    return ids.contiguous()


def read_heads_dir(directory: str | Path, hidden_size: int, vocab_size: int, min_heads: int = 1) -> HeadWeights:
    """check_heads() on a heads directory's two files."""
    d = Path(directory).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / name).is_file():
            raise MedusaHeadsError(f"medusa heads directory {directory} has no {name}")
    return check_heads((d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes(), hidden_size, vocab_size,
                       min_heads)


def read_adapter_heads(adapter_dir: str | Path, hidden_size: int, vocab_size: int) -> HeadWeights | None:
    """An adapter directory's own heads (its `medusa/` folder), checked against the base; None without."""
    d = Path(adapter_dir).expanduser() / ADAPTER_DIR
    if not d.exists():
        return None
    bounds = ((CONFIG_FILE, MAX_CONFIG_BYTES),
              (WEIGHTS_FILE, max_weights_bytes(MAX_ADAPTER_HEADS, hidden_size, vocab_size)))
    for name, bound in bounds:
        if not (d / name).is_file():
            raise MedusaHeadsError(f"the adapter's {ADAPTER_DIR}/ folder has no {name}")
        if (d / name).stat().st_size > bound:  # refused before it is read
            raise MedusaHeadsError(f"the adapter's {ADAPTER_DIR}/{name} is over the limit of {bound} bytes")
    return check_heads((d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes(), hidden_size, vocab_size,
                       max_heads=MAX_ADAPTER_HEADS)


def save_heads(directory: str | Path, weights: HeadWeights, vocab_size: int) -> None:
    """Write a heads directory (scripts/train_medusa_heads), in float16 (half the bytes, the same top-1), with
    its draft vocabulary (int32) if it has one."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    k, h = weights.weight.shape[:2]
    tensors = {}
    for i in range(k):
        tensors[f"heads.{i}.weight"] = weights.weight[i].to(torch.float16).contiguous()
        tensors[f"heads.{i}.bias"] = weights.bias[i].to(torch.float16).contiguous()
    if weights.draft_vocab is not None:
        tensors[DRAFT_VOCAB] = weights.draft_vocab.to(torch.int32).contiguous()
    save_file(tensors, str(d / WEIGHTS_FILE))
    (d / CONFIG_FILE).write_text(json.dumps({"num_heads": k, "hidden_size": h, "vocab_size": vocab_size}) + "\n")
