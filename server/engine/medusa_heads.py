"""Medusa heads (speculative method `medusa`): K small heads over the target's last hidden state, head i
guessing the token i + 1 places after the one the target chooses there.

Medusa-1's residual block, without a head's own lm_head: head i maps the last layer's output h (before the
final norm) to h + SiLU(W_i h + b_i), and the base model's final norm and lm_head turn that into logits,
so a head file holds K x (H x H + H) numbers and never a vocabulary-wide matrix. The drafts are each
head's top-1, one chain (no tree attention); the target verifies them like any drafts.

A heads directory holds `medusa_config.json` ({"num_heads": K, "hidden_size": H, "vocab_size": V}: the
base model's hidden size and vocabulary they were trained for) and `medusa_heads.safetensors`
(`heads.{i}.weight` [H, H], `heads.{i}.bias` [H], i < K). Whatever does not fit the base model is
refused in one line naming the mismatch (MedusaHeadsError).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from server.engine.kernel_ops import KernelOps

CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa_heads.safetensors"
_CONFIG_KEYS = ("num_heads", "hidden_size", "vocab_size")
# A config is a few numbers; anything longer is not one.
MAX_CONFIG_BYTES = 1 << 16


class MedusaHeadsError(ValueError):
    """Heads that do not fit the base model (or are not heads at all): one line naming the mismatch."""


@dataclass(frozen=True)
class MedusaHeadsConfig:
    num_heads: int  # K
    hidden_size: int  # the base model's hidden size they were trained on
    vocab_size: int  # and its vocabulary


@dataclass(frozen=True)
class HeadWeights:
    """Checked head tensors, on the host: weight [K, H, H] (out, in), bias [K, H]."""

    weight: torch.Tensor
    bias: torch.Tensor

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes


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


def check_heads(config: bytes | str, weights: bytes, hidden_size: int, vocab_size: int,
                min_heads: int = 1) -> HeadWeights:
    """The heads in a config's and a safetensors file's bytes, checked against a base model of this hidden
    size and vocabulary, with at least `min_heads` heads."""
    cfg = parse_config(config)
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
        if name not in expected:
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
    return HeadWeights(torch.stack([tensors[f"heads.{i}.weight"].float() for i in rng]),
                       torch.stack([tensors[f"heads.{i}.bias"].float() for i in rng]))


def read_heads_dir(directory: str | Path, hidden_size: int, vocab_size: int, min_heads: int = 1) -> HeadWeights:
    """check_heads() on a heads directory's two files."""
    d = Path(directory).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / name).is_file():
            raise MedusaHeadsError(f"medusa heads directory {directory} has no {name}")
    return check_heads((d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes(), hidden_size, vocab_size,
                       min_heads)


def save_heads(directory: str | Path, weights: HeadWeights, vocab_size: int) -> None:
    """Write a heads directory (scripts/train_medusa_heads), in float16: half the bytes, the same top-1."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    k, h = weights.weight.shape[:2]
    tensors = {}
    for i in range(k):
        tensors[f"heads.{i}.weight"] = weights.weight[i].to(torch.float16).contiguous()
        tensors[f"heads.{i}.bias"] = weights.bias[i].to(torch.float16).contiguous()
    save_file(tensors, str(d / WEIGHTS_FILE))
    (d / CONFIG_FILE).write_text(json.dumps({"num_heads": k, "hidden_size": h, "vocab_size": vocab_size}) + "\n")


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
