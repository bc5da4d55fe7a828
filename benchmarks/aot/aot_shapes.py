"""The engine's model on `meta` tensors at real model shapes, and the steps to drive it with.

`meta` tensors have shapes, strides and (offset-only) data pointers but no
storage, so the forward pass of an 8B model costs nothing and every Triton
launch it makes carries the arguments a GPU run would (benchmarks/aot/aot_check.py,
the kernel-plan tests). One decoder layer stands for all: layers are identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.expert_batch import ExpertBatch
from server.engine.config import ModelConfig
from server.engine.kv_cache_dtype import KV_CACHE_DTYPES, check_kv_cache_dtype_name
from server.engine.kv_cache import allocate_lora_slots, kv_bytes_per_block, lora_page_bytes
from server.engine.lora.paging import LoraPaging
from server.engine.model import CausalLM
from server.engine.unified_buffer import UnifiedBuffer, unallocated
from server.engine.unified_memory import UnifiedPool
from server.engine.warmup import SyntheticSeq, SyntheticStep

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
MODELS = {
    "llama3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "qwen2-7b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "llama3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
                    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    # Its attention is Llama-3-8B's; what it adds is the experts' LoRA (meta_experts_step).
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class EngineShape:
    model: str  # a key of MODELS
    dtype: str  # a key of DTYPES
    max_lora_rank: int
    max_loras: int = 8
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    num_kv_blocks: int = 4096
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: the pool's (server.engine.kv_cache_dtype)
    # --quantization int8 (with --quantize-lm-head: the vocabulary-wide launch too), int4 (the decoder
    # layers' projections), or None for float weights; fp8 runs torch._scaled_mm, no Triton kernel of ours.
    quantization: str | None = None
    # --lora-page-rows: adapter memory in pages of this many rank rows, read through a page table (the
    # kernels' PAGED variants); None: slots.
    lora_page_rows: int | None = None
    # --unified-memory: the KV caches and the adapter pages as strided views of one buffer
    # (server.engine.unified_buffer), at the full model's strides (its layer count, a page of every layer).
    unified_memory: bool = False

    def __post_init__(self) -> None:
        if self.unified_memory and self.lora_page_rows is None:
            raise ValueError("unified_memory needs lora_page_rows: adapter pages are what shares the pool")
        if self.model not in MODELS or self.dtype not in DTYPES:
            raise ValueError(f"unknown model {self.model!r} or dtype {self.dtype!r}")
        check_kv_cache_dtype_name(self.kv_cache_dtype)
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, int8 or int4 here, got {self.quantization!r}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")

    @property
    def label(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f"/kv-{self.kv_cache_dtype}"
        quant = "" if self.quantization is None else f"/{self.quantization}"
        pages = "" if self.lora_page_rows is None else f"/pages{self.lora_page_rows}"
        unified = "/unified" if self.unified_memory else ""
        return f"{self.model}/{self.dtype}/r{self.max_lora_rank}{kv}{quant}{pages}{unified}"

    @property
    def cache_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or DTYPES[self.dtype]

    def runs_on(self, capability: int) -> bool:
        """Whether the engine serves this shape on sm_<capability> (e4m3 KV needs 8.9: refused below)."""
        return self.cache_dtype != torch.float8_e4m3fn or capability >= 89


def meta_weights(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (Hugging Face names) on meta."""
    h, q, kv, i, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if cfg.attention_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (size,) for n, size in (("q", q), ("k", kv), ("v", kv))}
    return {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()}


def meta_engine(shape: EngineShape) -> tuple[CausalLM, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                              torch.Tensor | None]:
    """(model with one layer, its KV caches, the LoRA scratch, the adapter page table or None), all on meta,
    as LLMEngine allocates them."""
    cfg = ModelConfig.from_dict({**MODELS[shape.model], "num_hidden_layers": 1})
    dtype = DTYPES[shape.dtype]
    paging = LoraPaging.of(shape.max_loras, shape.max_lora_rank, shape.lora_page_rows)
    lora = allocate_lora_slots(cfg, shape.max_loras, shape.max_lora_rank, dtype, "meta", paging,
                               unallocated if shape.unified_memory else None)
    table = torch.zeros(paging.entries, paging.pages_per_entry, dtype=torch.int32,
                        device="meta") if paging.paged else None
    model = CausalLM(cfg, meta_weights(cfg, dtype), lora, shape.max_model_len, shape.max_num_batched_tokens,
                     shape.quantization, quantize_lm_head=shape.quantization == "int8")
    if shape.unified_memory:
        kv = _unified_views(shape, paging, lora)
    else:
        pool = (shape.num_kv_blocks, shape.block_size, cfg.num_kv_heads, cfg.head_dim)
        kv = [(torch.empty(pool, dtype=shape.cache_dtype, device="meta"),
               torch.empty(pool, dtype=shape.cache_dtype, device="meta"))]
    scratch = torch.empty(3, shape.max_num_batched_tokens, shape.max_lora_rank, dtype=dtype, device="meta")
    return model, kv, scratch, table


def _unified_views(shape: EngineShape, paging: LoraPaging, lora: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """--unified-memory's layout on meta: the full model's pool (every layer's K and V in a unit, every
    layer's rows in a page), `lora`'s one layer carved from it and layer 0's KV views, as the engine has them."""
    full = ModelConfig.from_dict(MODELS[shape.model])
    pool = UnifiedPool.of(shape.num_kv_blocks, kv_bytes_per_block(full, shape.block_size, shape.cache_dtype),
                          lora_page_bytes(full, paging.page_rows, DTYPES[shape.dtype]), paging.pages - 1)
    memory = UnifiedBuffer.allocate(pool, "meta")
    memory.carve_pages(lora)
    return memory.kv_caches(full.num_layers, shape.block_size, full.num_kv_heads, full.head_dim,
                            shape.cache_dtype)[:1]


def is_moe(shape: EngineShape) -> bool:
    return ModelConfig.from_dict(MODELS[shape.model]).is_moe


def meta_experts_step(shape: EngineShape, ops, step: SyntheticStep) -> None:
    """An MoE layer's expert LoRA launches for a step of `step`'s tokens, on meta. The forward itself cannot
    run on meta (its routing reads the router's choices on the host), and its attention and projections
    are a dense model's launches (the AOT set has them); so the experts' calls are made directly, every
    routed pair on an adapter, as many as the step's tokens times top-k."""
    cfg = ModelConfig.from_dict({**MODELS[shape.model], "num_hidden_layers": 1})
    dtype = DTYPES[shape.dtype]
    groups = allocate_lora_slots(cfg, shape.max_loras, shape.max_lora_rank, dtype, "meta")[0]
    pairs = sum(s.query_len for s in step.seqs) * cfg.num_experts_per_tok

    def meta(*size: int, dt=dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dt, device="meta")

    batch = ExpertBatch(meta(pairs, dt=torch.int64), meta(pairs, dt=torch.int32), meta(pairs, dt=torch.int32),
                        meta(pairs), (0,) * cfg.num_experts + (pairs,), (), step.rank)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for group, width_in, width_out in (("experts_gate_up", h, 2 * i), ("experts_down", i, h)):
        lora = groups[group]
        ops.lora.apply_experts(meta(pairs, width_in), lora.a, lora.b, lora.scaling, batch, meta(pairs, width_out))


def _slot(i: int) -> int:
    """Adapter slot of request i: a few popular adapters, a tail, and base-model requests between."""
    return -1 if i % 5 == 4 else (0 if i % 3 == 0 else i % 8)


def mixed_batch(chunk: int = 1793, decodes: int = 255) -> tuple[SyntheticSeq, ...]:
    """A chunk of a long prompt continuing its cached prefix, plus many decodes: 2048 tokens."""
    return (SyntheticSeq(2000, chunk, 0), *(SyntheticSeq(50 + 13 * i, 1, _slot(i)) for i in range(decodes)))


def verify_rows(rows: int, width: int, padded: bool) -> tuple[SyntheticSeq, ...]:
    """A speculative verify step of `rows` sequences, each its last token and width - 1 drafts: eager, a
    width-token query per sequence; padded (server.engine.decode_graphs), one one-token row per token, each
    at its own position over its sequence's table."""
    contexts = [(1000 + 250 * i, _slot(i)) for i in range(rows)]
    if not padded:
        return tuple(SyntheticSeq(c, width, slot) for c, slot in contexts)
    return tuple(SyntheticSeq(c + j, 1, slot) for c, slot in contexts for j in range(width))


def scenarios(shape: EngineShape) -> dict[str, list[SyntheticStep]]:
    """Decode (1, 8, 256 sequences), prefill, chunked prefill, mixed and speculative verify steps (eager and
    padded, 1, 8 and 32 sequences of k + 1 = 5 tokens), at every rank 8..64 and the max."""
    mixes = {
        "decode-1": (SyntheticSeq(4095, 1, 0),),
        "decode-8": tuple(SyntheticSeq(1000 + 250 * i, 1, _slot(i)) for i in range(8)),
        "decode-256": tuple(SyntheticSeq(100 + 7 * i, 1, _slot(i)) for i in range(256)),
        "prefill": (SyntheticSeq(0, 2048, 0), SyntheticSeq(0, 517, 1), SyntheticSeq(0, 3, 2),
                    SyntheticSeq(0, 40, -1), SyntheticSeq(0, 21, 3)),
        "chunked": (SyntheticSeq(3000, 1024, 1), SyntheticSeq(0, 20, 2)),
        "mixed": mixed_batch(),
        **{f"verify-{rows}x5{'-padded' if padded else ''}": verify_rows(rows, 5, padded)
           for rows in (1, 8, 32) for padded in (False, True)},
    }
    ranks = sorted({r for r in (8, 16, 32, 64) if r <= shape.max_lora_rank} | {shape.max_lora_rank})
    return {name: [SyntheticStep(seqs, r) for r in ranks] for name, seqs in mixes.items()}
