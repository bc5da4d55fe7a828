"""Decoder-only transformers (Llama 2/3, Mistral, Qwen2/3, Phi-3/4, Gemma 2/3) over a paged KV cache with
batched multi-LoRA, with their rotary position embeddings (RotaryEmbedding) and the activation buffers one
forward reuses across layers (Workspace).

Projections are fused (qkv, gate_up) so one base matmul and one LoRA
shrink/expand pair serve each fused layer for the whole mixed-adapter batch.

Rotary position embeddings (RotaryEmbedding), matching transformers' (default, linear, llama3, yarn).

The forward's activation buffers (Workspace): allocated once at the step's maximum size, reused by every layer.

Why: on CPU a fresh prefill-sized output costs page faults on every layer. glibc serves blocks over
32 MB straight from mmap, so each one is new, unmapped memory. A 4096-token gate_up output of the
smol135 shape (50 MB) took 97 ms into a new tensor and 80 ms into a reused one (2 threads); at 8B
widths every projection's output is over that size. Layers run one after another, so one set of
buffers serves all of them: a layer's outputs are consumed before the next layer writes its own.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields, is_dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kernels.dora_scale import dora_scale
from kernels.fp8_weights import Fp8Weight, quantize_fp8
from kernels.int4_weights import DEFAULT_GROUP_SIZE, Int4Weight, cat_int4, quantize_int4
from kernels.int8_weights import Int8Weight, quantize_int8
from kernels.metadata import AttentionBatch, LoraBatch
from kernels.rms_norm_ref import rms_norm
from server.engine.config import ModelConfig
from server.engine.host_memory import return_freed_memory
from server.engine.kernel_ops import KernelOps
from server.engine.lora.slots import LoraGroupBuffers
from server.engine.lora.vocab_parts import VocabParts
from server.engine.moe_block import MoeBlock
from server.engine.moe_weights import take_experts


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    assert kind == "llama3", kind
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, op for op): interpolated frequencies below a
    ramp over the dimensions, original ones above it."""
    factor = float(scaling["factor"])
    old_len = scaling["original_max_position_embeddings"]  # ModelConfig fills it in when absent
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, 1 elsewhere."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]))
    return mscale()


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, built once."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling, dtype, device) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        factor = attention_factor(scaling)
        self.cos = (emb.cos() * factor).to(dtype=dtype, device=device)  # [P, D]
        # rotate_half(x) * sin = cat(-x2, x1) * sin = cat(x2, x1) * cat(-sin1, sin2): the sign moves
        # into the table (exact: negation commutes with rounding), one op less per call.
        half = head_dim // 2
        sin = emb.sin() * factor
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype=dtype, device=device)  # [P, D]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's rows of the tables, gathered once for all its layers: (cos, signed sin), each
        [T, 1, D], from positions [T]."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.signed_sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D]; tables: from tables() for the step's positions."""
        cos, sin = tables
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class Workspace:
    qkv: torch.Tensor  # [max_tokens, q + 2 kv], the fused qkv projection's output
    attn: torch.Tensor  # [max_tokens, Hq, D], attention's output
    o: torch.Tensor  # [max_tokens, H]
    gate_up: torch.Tensor  # [max_tokens, 2 I]
    act: torch.Tensor  # [max_tokens, I], silu(gate) * up: down's input
    down: torch.Tensor  # [max_tokens, H]
    # [largest projection's out * in], where an int8 or int4 weight is turned back into floats before
    # its matmul (kernels.int8_weights.dequant_linear; kernels.int4_avx2 past 16 rows); None for float weights.
    dequant: torch.Tensor | None = None

    @staticmethod
    def allocate(cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device | str,
                 dequant: bool = False) -> Workspace:
        assert max_tokens >= 1
        h, i = cfg.hidden_size, cfg.intermediate_size
        largest = max((cfg.q_size + 2 * cfg.kv_size) * h, cfg.q_size * h, 2 * i * h)

        def buf(*shape: int) -> torch.Tensor:
            return torch.empty(max_tokens, *shape, dtype=dtype, device=device)

        return Workspace(
            qkv=buf(cfg.q_size + 2 * cfg.kv_size), attn=buf(cfg.num_heads, cfg.head_dim), o=buf(cfg.hidden_size),
            gate_up=buf(2 * cfg.intermediate_size), act=buf(cfg.intermediate_size), down=buf(cfg.hidden_size),
            dequant=torch.empty(largest, dtype=dtype, device=device) if dequant else None,
        )

    @property
    def max_tokens(self) -> int:
        return self.qkv.shape[0]


@dataclass
class StepContext:
    """Everything a layer needs about the current step; built once, shared by all layers."""

    ops: KernelOps
    positions: torch.Tensor  # [T] int64
    attn: AttentionBatch
    lora: LoraBatch
    lora_scratch: torch.Tensor  # [3, max_tokens, R], shrink output
    # Per KV layer group (server.engine.kv_groups), its block tables' AttentionBatch, attn being group 0's;
    # () with one group.
    group_attn: tuple[AttentionBatch, ...] = ()


class RMSNorm:
    """Llama's RMSNorm, or Gemma's (plus_one): gain 1 + w, applied in float32 before the cast back
    (kernels.rms_norm_ref: the same order of operations as transformers', so float32 matches bit for bit)."""

    def __init__(self, weight: torch.Tensor, eps: float, plus_one: bool) -> None:
        self.weight = 1.0 + weight.float() if plus_one else weight  # as Gemma computes it, once
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Any shape normed over its last dim, in torch (the q/k norms' per-head rows)."""
        return rms_norm(x, self.weight, self.eps, self.plus_one)

    def rows(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """[T, H] rows normed by the step's kernels (one launch with Triton's)."""
        return ops.rms_norm(x, self.weight, self.eps, self.plus_one)

    def add_rows(self, x: torch.Tensor, residual: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """residual += x in place, then its rows normed: one launch with Triton's kernels."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.plus_one)


class LoraLinear:
    """A base linear layer (possibly several fused projections) plus its LoRA slots."""

    def __init__(self, weight: torch.Tensor | Int8Weight | Int4Weight | Fp8Weight, bias: torch.Tensor | None,
                 lora: LoraGroupBuffers, dequant_scratch: torch.Tensor | None = None,
                 dora_cols: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in], float, or int8 / fp8 with per-row scales, or int4 with per-group ones
        self.bias = bias  # [out] or None
        self.lora = lora
        self.dequant_scratch = dequant_scratch  # the workspace's, for an int8 or int4 weight (Workspace.dequant)
        # The DoRA table's columns this layer's outputs are (a tensor-parallel rank's, whose table stays the
        # slots' whole one: server.engine.parallel.tp_layers); None: all of them.
        self.dora_cols = dora_cols

    def __call__(self, x: torch.Tensor, ctx: StepContext, out: torch.Tensor) -> torch.Tensor:
        """out: [T, out] workspace rows the result is written into (and returned)."""
        y = self.project(x, ctx, out)
        if ctx.lora.any_lora:
            h = ctx.lora_scratch[: self.lora.a.shape[0], : x.shape[0]]  # [S, T, R]
            lora = self.lora
            ctx.ops.lora.apply(x, lora.a, lora.b, lora.scaling, lora.offsets, ctx.lora, h, y)
        self.rescale(y, ctx)
        return y

    def project(self, x: torch.Tensor, ctx: StepContext, out: torch.Tensor) -> torch.Tensor:
        """x W^T into out, plus the bias unless the step has DoRA rows (rescale adds it after their scales)."""
        bias = None if ctx.lora.dora else self.bias  # DoRA scales multiply x W^T + the LoRA delta
        if isinstance(self.weight, Int8Weight):
            return ctx.ops.int8_linear(x, self.weight, bias, out=out, scratch=self.dequant_scratch)  # [T, out]
        if isinstance(self.weight, Int4Weight):
            return ctx.ops.int4_linear(x, self.weight, bias, out=out, scratch=self.dequant_scratch)  # [T, out]
        if isinstance(self.weight, Fp8Weight):
            return ctx.ops.fp8_linear(x, self.weight, bias, out=out)  # [T, out]
        return ctx.ops.linear(x, self.weight, bias, out=out)  # x: [T, in] -> y: [T, out]

    def rescale(self, y: torch.Tensor, ctx: StepContext) -> None:
        """A step with DoRA rows: y (x W^T plus the LoRA delta) times each row's DoRA scales, then the bias."""
        if ctx.lora.dora:
            dora_scale(y, self.lora.dora_scale, ctx.lora, self.bias, self.dora_cols)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], lora: dict[str, LoraGroupBuffers], rope,
                 quantization: str | None = None, dequant_scratch: torch.Tensor | None = None,
                 int4_group_size: int = DEFAULT_GROUP_SIZE, index: int = 0) -> None:
        """quantization: None (float projections), "int8" (kernels.int8_weights), "int4"
        (kernels.int4_weights) or "fp8" (kernels.fp8_weights), quantized here after fusing: scales are
        per output row, so fused and unfused quantization agree. An int4 weight may come quantized
        already (a GPTQ checkpoint's, server.engine.weights). index: the layer's, for its window and rope
        (Gemma's sliding layers)."""
        self.cfg = cfg
        self.rope = rope

        def norm(name: str) -> RMSNorm | None:
            return RMSNorm(w[name], cfg.rms_norm_eps, cfg.norm_plus_one) if name in w else None

        self.input_norm = norm("input_layernorm.weight")
        # Sandwich norms (Gemma): post_attention_layernorm normalises the attention's output, and the MLP
        # has its own pair; otherwise post_attention_layernorm is the MLP's input norm.
        self.post_norm = norm("post_attention_layernorm.weight")
        self.pre_mlp_norm, self.post_mlp_norm = norm("pre_feedforward_layernorm.weight"), norm("post_feedforward_layernorm.weight")
        self.q_norm, self.k_norm = norm("q_norm.weight"), norm("k_norm.weight")  # over [D] each, or None
        self.window = cfg.layer_windows[index] if cfg.layer_windows else None
        groups = cfg.kv_groups
        self.kv_group = groups.layer_group[index] if groups is not None else 0  # whose block tables it reads
        self.local = self.window is not None and cfg.local_rope_theta is not None  # the sliding layers' rope
        self.act = (partial(F.gelu, approximate="tanh") if cfg.hidden_act == "gelu_pytorch_tanh"
                    else partial(F.silu, inplace=True))  # on workspace rows: overwritten in place where it can be

        def base(name: str) -> LoraLinear:
            weight = w.pop(f"{name}.weight")
            assert quantization == "int4" or not isinstance(weight, Int4Weight), "only int4 keeps a checkpoint's int4"
            if quantization == "int4" and not isinstance(weight, Int4Weight):
                weight = quantize_int4(weight, int4_group_size)
            elif quantization == "int8":
                weight = quantize_int8(weight)
            elif quantization == "fp8":
                weight = quantize_fp8(weight)
            return LoraLinear(weight, w.get(f"{name}.bias"), lora[name.removesuffix("_proj")], dequant_scratch)

        self.qkv = base("qkv")
        self.o = base("o_proj")
        # An MoE layer's experts in place of the dense MLP (server.engine.moe_block).
        sparse = "experts" in w  # a dense layer of an MoE model (Qwen3-MoE's) has the dense MLP
        self.moe = (MoeBlock(cfg, w.pop("experts"), lora["experts_gate_up"], lora["experts_down"]) if sparse
                    else None)
        self.gate_up = None if sparse else base("gate_up")
        self.down = None if sparse else base("down_proj")
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def projections(self) -> list[LoraLinear]:
        """The layer's LoRA-served linear layers (an MoE layer's experts are not among them)."""
        return [lin for lin in (self.qkv, self.o, self.gate_up, self.down) if lin is not None]

    def __call__(self, h: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], ctx: StepContext,
                 rope: tuple[torch.Tensor, torch.Tensor], ws: Workspace,
                 pending: torch.Tensor | None = None) -> torch.Tensor:
        """Adds pending (the previous layer's return, [T, H]) and this layer onto the residual h [T, H] in
        place, all but the layer's last addend (its MLP's output), which it returns for the next layer's
        input norm to add in the same launch (or the caller to add after the last layer). rope: the step's
        rotary tables (RotaryEmbedding.tables), shared by all layers; ws: the model's activation buffers."""
        cfg = self.cfg
        t = h.shape[0]
        x = self.input_norm.rows(h, ctx.ops) if pending is None else self.input_norm.add_rows(pending, h, ctx.ops)
        q, k, v = self.qkv(x, ctx, ws.qkv[:t]).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, k = q.reshape(t, cfg.num_heads, cfg.head_dim), k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope.apply(q, rope)  # [T, Hq, D]
        k = self.rope.apply(k, rope)  # [T, Hkv, D]
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv
        batch = ctx.group_attn[self.kv_group] if ctx.group_attn else ctx.attn
        write_kv = ctx.ops.write_kv_padded if batch.padded else ctx.ops.write_kv
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        attn = ws.attn[:t]  # [T, Hq, D]
        if cfg.attn_softcap is None and self.window is None:
            ctx.ops.paged_attention(q, k_cache, v_cache, batch, self.scale, attn)
        else:
            ctx.ops.paged_attention(q, k_cache, v_cache, batch, self.scale, attn, cfg.attn_softcap, self.window)
        o = self.o(attn.view(t, cfg.q_size), ctx, ws.o[:t])
        if self.pre_mlp_norm is None:
            x = self.post_norm.add_rows(o, h, ctx.ops)  # h += o, then normed: one launch with Triton's
        else:
            x = self.pre_mlp_norm.add_rows(self.post_norm.rows(o, ctx.ops), h, ctx.ops)
        if self.moe is not None:
            return self.moe(x, ctx)
        gate, up = self.gate_up(x, ctx, ws.gate_up[:t]).split([cfg.intermediate_size, cfg.intermediate_size], dim=-1)
        act = torch.mul(self.act(gate), up, out=ws.act[:t])
        down = self.down(act, ctx, ws.down[:t])
        return down if self.post_mlp_norm is None else self.post_mlp_norm.rows(down, ctx.ops)


class CausalLM:
    """Embedding -> decoder layers -> norm; logits only for the rows asked for.

    Consumes `weights`: each layer's tensors are taken out of the dict as it is built.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], lora_layers, max_positions: int,
                 max_tokens: int, quantization: str | None = None, quantize_lm_head: bool = False,
                 int4_group_size: int = DEFAULT_GROUP_SIZE) -> None:
        """max_tokens: the most tokens one forward takes (max_num_batched_tokens), the workspace's rows.
        quantization: None, "int8", "int4" or "fp8" for the decoder layers' projections; int4_group_size:
        int4's groups where it quantizes a float weight (a GPTQ checkpoint's come quantized). The lm_head stays float
        unless quantize_lm_head (int8 only): the logits are where rounding shows most (GPTQ/AWQ keep it
        float by default), and where tied it is the embedding itself, whose gather needs float rows, so
        int8 adds a copy (a quarter of the embedding) rather than saving one. What it buys is speed: on
        a CPU the lm_head is the largest matmul of a decode step (docs/benchmarks/int8-cpu.md)."""
        self.cfg = cfg
        some = weights["model.embed_tokens.weight"]
        self.workspace = Workspace.allocate(cfg, max_tokens, some.dtype, some.device,
                                            dequant=quantization in ("int8", "int4") and some.device.type == "cpu")
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, some.dtype, some.device)
        # Gemma 3's sliding layers: their own base, unscaled.
        self.local_rope = (None if cfg.local_rope_theta is None else
                           RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta, None, some.dtype, some.device))
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        # Gemma's embeddings times sqrt(hidden), that factor rounded to the embedding's dtype first as transformers does.
        self.embed_scale = (torch.tensor(cfg.hidden_size**0.5).to(some.dtype).item() if cfg.scale_embeddings
                            else None)
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_plus_one)
        lm_head = self.embed if cfg.tie_word_embeddings else weights.pop("lm_head.weight")  # [V, H]
        assert not quantize_lm_head or quantization == "int8", "EngineConfig checks it"
        self.lm_head = quantize_int8(lm_head) if quantize_lm_head else lm_head  # [V, H], float or int8
        self.rope = rope
        # Adapters' parts of embed_tokens and lm_head, per slot (engine_startup sets it); None: none served.
        self.vocab_parts: VocabParts | None = None
        self.layers = [
            DecoderLayer(cfg, layer_weights(weights, i, cfg), lora_layers[i], rope, quantization,
                         self.workspace.dequant, int4_group_size, i)
            for i in range(cfg.num_layers)
        ]
        if some.device.type == "cpu":
            return_freed_memory()  # the float projections just freed: their heap holes back to the OS

    def base_weights(self) -> dict:
        """What the decoder projections and the lm_head are stored as, the projections' bytes on the
        device (quantized or not), and every base weight's bytes by dtype (`bytes_by_dtype`, totalling
        `bytes`; a tied lm_head counted once): /admin/engine's `base_weights`."""
        lins = [lin.weight for layer in self.layers for lin in layer.projections()]
        kinds = {type(w).__name__ for w in lins}
        assert len(kinds) == 1, "every projection is stored alike"
        first = lins[0]
        kind = {Int8Weight: "int8", Int4Weight: "int4", Fp8Weight: "fp8"}.get(type(first))
        by_dtype = Counter()
        for t in self.base_tensors():
            by_dtype[str(t.dtype).removeprefix("torch.")] += t.nbytes
        return {"projections": kind or str(first.dtype).removeprefix("torch."),
                "int4_group_size": first.group_size if isinstance(first, Int4Weight) else None,
                "projection_bytes": sum(w.nbytes for w in lins),
                "lm_head": "int8" if isinstance(self.lm_head, Int8Weight) else str(self.lm_head.dtype).removeprefix("torch."),
                "bytes_by_dtype": dict(sorted(by_dtype.items())), "bytes": sum(by_dtype.values())}

    def base_tensors(self) -> list[torch.Tensor]:
        """Every tensor the base model's weights are stored in (a quantized weight's values, scales
        and offsets), each once: not the LoRA slots, the workspace or the rotary tables."""
        held = [self.embed, self.norm.weight, self.lm_head]
        for layer in self.layers:
            norms = (layer.input_norm, layer.post_norm, layer.pre_mlp_norm, layer.post_mlp_norm, layer.q_norm,
                     layer.k_norm)
            held += [norm.weight for norm in norms if norm is not None]
            for lin in layer.projections():
                held += [lin.weight, lin.bias]
            held += layer.moe.weight_tensors() if layer.moe is not None else []
        tensors = [t for w in held if w is not None for t in _stored_tensors(w)]
        return list({id(t): t for t in tensors}.values())  # a tied lm_head is the embedding itself

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ctx: StepContext,
        logits_indices: torch.Tensor,  # [N] rows whose next token is sampled
    ) -> torch.Tensor:
        h = self.hidden_rows(input_ids, kv_caches, ctx, logits_indices)
        return self.logits(h, ctx.ops, ctx.lora, logits_indices)

    @torch.inference_mode()
    def hidden_rows(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ctx: StepContext,
        logits_indices: torch.Tensor,  # [N]
    ) -> torch.Tensor:
        """The last layer's output (before the final norm) at the rows asked for, [N, H]: forward() less
        the logits, for Medusa heads (server.engine.medusa_heads) to read as well."""
        assert input_ids.shape[0] <= self.workspace.max_tokens, "the scheduler bounds a step's tokens"
        h = self.embed.index_select(0, input_ids)  # [T, H], a new tensor: the layers add onto it in place
        if self.embed_scale is not None:
            h *= self.embed_scale
        vocab = self.vocab_parts.active(ctx.lora) if self.vocab_parts is not None else []
        if vocab:
            self.vocab_parts.embed(h, input_ids, ctx.lora, vocab, self.embed_scale)
        rope = self.rope.tables(ctx.positions)
        local = self.local_rope.tables(ctx.positions) if self.local_rope is not None else None
        pending = None  # a layer's MLP output, added by the next layer's input norm in its launch
        for layer, kv in zip(self.layers, kv_caches):
            pending = layer(h, kv, ctx, local if layer.local else rope, self.workspace, pending)
        h += pending
        return h.index_select(0, logits_indices)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, ops: KernelOps, lora=None, logits_indices: torch.Tensor | None = None
               ) -> torch.Tensor:
        """[N, H] last-layer rows -> [N, V] float32 logits: the final norm and the lm_head; with the step's
        LoRA batch and the rows' indices, adapters' own lm_head parts too (VocabParts)."""
        h = self.norm.rows(h, ops)
        if isinstance(self.lm_head, Int8Weight):  # a fresh [N, V]: no scratch, the kernels read int8 in place
            logits = ops.int8_linear(h, self.lm_head)  # [N, V]
        else:
            logits = ops.linear(h, self.lm_head)  # [N, V]
        vocab = self.vocab_parts.active(lora) if self.vocab_parts is not None and lora is not None else []
        if vocab:
            self.vocab_parts.logits(logits, h, lora, logits_indices, vocab)
        if self.cfg.final_softcap is not None:  # Gemma: softcap * tanh(logits / softcap)
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits.float()

    def lm_head_rows(self, ids: torch.Tensor):
        """A copy of the lm_head's rows `ids` [N] (a Medusa draft vocabulary's), stored as the lm_head is:
        a float [N, H] or an Int8Weight of N rows."""
        if isinstance(self.lm_head, Int8Weight):
            return Int8Weight(self.lm_head.qweight.index_select(0, ids).contiguous(),
                              self.lm_head.scale.index_select(0, ids).contiguous())
        return self.lm_head.index_select(0, ids).contiguous()

    def row_logits(self, h: torch.Tensor, ops: KernelOps, rows) -> torch.Tensor:
        """[N, H] last-layer rows -> [N, R] logits over lm_head_rows()' R rows: the final norm and those
        rows alone, for a draft's top-1 (no adapter vocab parts; a softcap keeps the order, so none)."""
        h = self.norm.rows(h, ops)
        return ops.int8_linear(h, rows) if isinstance(rows, Int8Weight) else ops.linear(h, rows)


def _stored_tensors(weight) -> list[torch.Tensor]:
    """A float weight itself, or a quantized one's tensors (Int8Weight, Int4Weight, Fp8Weight fields)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    assert is_dataclass(weight), type(weight)
    return [v for f in fields(weight) if isinstance(v := getattr(weight, f.name), torch.Tensor)]


def layer_weights(weights: dict[str, torch.Tensor], i: int, cfg: ModelConfig) -> dict:
    """One layer's tensors, with q/k/v and gate/up fused along the output dimension (an MoE layer's
    experts stacked under "experts": server.engine.moe_weights.ExpertWeights).

    Takes the layer's tensors out of `weights`: the unfused projections are freed as each layer is
    fused, so loading peaks at one layer's extra copy (not 9 GB on Llama-3-8B) and the KV pool is
    sized after they are gone.
    """
    p = f"model.layers.{i}."
    take = weights.pop
    w = {
        "input_layernorm.weight": take(p + "input_layernorm.weight"),
        "post_attention_layernorm.weight": take(p + "post_attention_layernorm.weight"),
        "o_proj.weight": take(p + "self_attn.o_proj.weight"),
    }
    if cfg.is_sparse(i):
        w["qkv.weight"] = _fuse([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        w["experts"] = take_experts(weights, cfg, i)
        return w | _norms_and_biases(weights, p)
    w["down_proj.weight"] = take(p + "mlp.down_proj.weight")
    if p + "self_attn.qkv_proj.weight" in weights:  # fused in the checkpoint (checkpoint_layout)
        w["qkv.weight"] = take(p + "self_attn.qkv_proj.weight")
        w["gate_up.weight"] = take(p + "mlp.gate_up_proj.weight")
    else:
        w["qkv.weight"] = _fuse([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        w["gate_up.weight"] = _fuse([take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return w | _norms_and_biases(weights, p)


def _norms_and_biases(weights, p: str) -> dict:
    """Layer `p`'s optional tensors: q/k and sandwich norms, biases (q/k/v fused, gate/up fused)."""
    take = weights.pop
    w = {}
    for norm in ("self_attn.q_norm", "self_attn.k_norm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        if p + f"{norm}.weight" in weights:
            w[f"{norm.removeprefix('self_attn.')}.weight"] = take(p + f"{norm}.weight")
    if p + "self_attn.q_proj.bias" in weights:
        w["qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
    for name, key in (("o_proj.bias", "self_attn.o_proj.bias"), ("down_proj.bias", "mlp.down_proj.bias")):
        if p + key in weights:
            w[name] = take(p + key)
    if p + "mlp.gate_proj.bias" in weights:
        w["gate_up.bias"] = torch.cat([take(p + f"mlp.{n}_proj.bias") for n in ("gate", "up")])
    return w


def _fuse(parts: list[torch.Tensor | Int4Weight]) -> torch.Tensor | Int4Weight:
    """Projections sharing their input, stacked along the output dimension (a GPTQ checkpoint's int4
    parts stay int4: their groups run along the shared input)."""
    if all(isinstance(part, Int4Weight) for part in parts):
        return cat_int4(parts)
    assert not any(isinstance(part, Int4Weight) for part in parts), "a fused projection is all int4 or all float"
    return torch.cat(parts)
