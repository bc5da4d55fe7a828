"""A CausalLM cut for one tensor-parallel rank, and the refusals of what this slice does not shard.

Each rank holds its q and kv heads (qkv column-parallel, o row-parallel), its intermediate columns
(gate_up column-parallel, down row-parallel), and its rows of the lm_head (vocabulary-parallel, the
logits gathered); the embedding is replicated (a lookup needs no communication, and a vocabulary-
parallel one would add an all_reduce of [T, H] per step for memory the first slice does not need).
Its KV cache holds its kv heads only. Per layer per step: two all_reduces of [T, H]; per step: one
all_gather of [N, V / tp] logits.

Every dense architecture the engine serves shards this way: what sets them apart is per head or per
hidden row, so it needs no communication of its own. Qwen3's and Gemma 3's q/k norms are over one
head's D; Gemma's sandwich norms (post_attention_layernorm on o, post_feedforward_layernorm on down) read
the all_reduced [T, H]; its attention soft-cap is per score and its final soft-cap per logit (applied to
each shard before the gather); its windowed layers and KV layer groups are per sequence and block, not
per head, so a rank's pool is rank 0's blocks (shared across groups as rank 0's are) with its heads.
Phi-3's checkpoint fuses qkv and gate_up as the engine does, and its adapters' fused lora_B rows are
split into q/k/v and gate/up at intake (adapters.format), so its slots cut as Llama's. MoE layers
(Mixtral, Qwen3-MoE) cut every expert's intermediate columns the same way (server.engine.parallel.tp_moe).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kernels.int4_weights import DEFAULT_GROUP_SIZE
from server.engine.architectures import ARCHITECTURES
from server.engine.config import ModelConfig
from server.engine.kv_cache import kv_pool_like
from server.engine.model import CausalLM, DecoderLayer, StepContext, Workspace
from server.engine.parallel.collectives import Collectives
from server.engine.parallel.sharded_lora import ShardedColumnLora, ShardedRowLora
from server.engine.parallel.tp_group import TpGroup
from server.engine.parallel.tp_layers import RowParallelLinear, column_parallel
from server.engine.parallel.tp_moe import TpMoeBlock
from server.engine.parallel.tp_weights import fp8_refusal, int4_split_refusal, vocab_shard

# The architectures tensor parallelism shards: every one the engine serves.
TP_ARCHS = tuple(ARCHITECTURES)


def tp_refusal(mcfg: ModelConfig, quantization: str | None, world_size: int, fully_sharded_loras: bool = False,
               max_lora_rank: int = 0, int4_group_size: int | None = None) -> str | None:
    """The one line --tensor-parallel-size N > 1 is refused with for this model, or None. int4_group_size:
    the int4 base's groups (--int4-group-size, or a GPTQ checkpoint's), with quantization "int4"."""
    if mcfg.architecture not in TP_ARCHS:
        return (f"--tensor-parallel-size {world_size}: architecture {mcfg.architecture} is not sharded yet "
                f"(supported: {', '.join(TP_ARCHS)})")
    if quantization == "fp8":
        return fp8_refusal(world_size)
    if mcfg.is_moe and fully_sharded_loras:
        return (f"--fully-sharded-loras does not combine with an MoE base ({mcfg.architecture}) yet: its experts' "
                f"LoRA is sharded as the default mode's")
    for n, what in ((mcfg.num_heads, "num_attention_heads"), (mcfg.num_kv_heads, "num_key_value_heads"),
                    (mcfg.intermediate_size, "intermediate_size"),
                    *(((mcfg.moe_intermediate_size, "moe_intermediate_size"),) if mcfg.is_moe else ()),
                    *(((mcfg.hidden_size, "hidden_size"), (max_lora_rank, "--max-lora-rank"))
                      if fully_sharded_loras else ())):
        if n % world_size:
            return f"--tensor-parallel-size {world_size} does not divide {what} ({n})"
    if quantization == "int4":  # the row-parallel projections' inputs split: o (heads), down (intermediate)
        return int4_split_refusal(int4_group_size or DEFAULT_GROUP_SIZE,
                                  {"o_proj": mcfg.num_heads // world_size * mcfg.head_dim,
                                   "down_proj": mcfg.intermediate_size // world_size}, world_size)
    return None


class TpCausalLM(CausalLM):
    """The rank's shard of a built CausalLM (whose state it takes over): the same forward, each decoder
    layer on its heads and intermediate columns, the logits gathered so every rank samples alike."""

    def __init__(self, full: CausalLM, tp: TpGroup, comm: Collectives, fully_sharded_loras: bool = False) -> None:  # adopts `full`: no CausalLM.__init__
        self.__dict__.update(full.__dict__)
        cfg = full.cfg
        self.tp = tp
        self.comm = comm
        q_span, kv_span = tp.span(cfg.num_heads, "num_attention_heads"), tp.span(cfg.num_kv_heads, "num_key_value_heads")
        i_span = tp.span(cfg.intermediate_size, "intermediate_size")
        moe_span = tp.span(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.local_cfg = replace(cfg, num_heads=q_span[1] - q_span[0], num_kv_heads=kv_span[1] - kv_span[0],
                                 intermediate_size=i_span[1] - i_span[0],
                                 moe_intermediate_size=moe_span[1] - moe_span[0])
        d = cfg.head_dim
        heads = tuple((lo * d, hi * d) for lo, hi in (q_span, kv_span, kv_span))
        max_rank = full.layers[0].qkv.lora.a.shape[2]
        lora_shards = ((tp.span(max_rank, "max_lora_rank"), tp.span(cfg.hidden_size, "hidden_size"))
                       if fully_sharded_loras else None)
        for layer in self.layers:
            _shard_layer(layer, self.local_cfg, heads, i_span, tp, comm, lora_shards)
            if layer.moe is not None:
                layer.moe = TpMoeBlock(layer.moe, self.local_cfg, moe_span, comm)
        ws = full.workspace
        self.workspace = Workspace.allocate(self.local_cfg, ws.max_tokens, ws.qkv.dtype, ws.qkv.device)
        # Rows of the lm_head: padded to a multiple of the world size with zero rows, trimmed after the gather.
        self.lm_head = vocab_shard(full.lm_head, tp.rank, tp.world_size)
        self.vocab_size = full.lm_head.shape[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                ctx: StepContext, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [N, V], the same on every rank (the shards' [N, V / tp] side by side)."""
        return self.comm.gather_last(super().forward(input_ids, kv_caches, ctx, logits_indices))[:, : self.vocab_size]


def _shard_layer(layer: DecoderLayer, local_cfg: ModelConfig, heads: tuple[tuple[int, int], ...],
                 i_span: tuple[int, int], tp: TpGroup, comm: Collectives,
                 lora_shards: tuple[tuple[int, int], tuple[int, int]] | None) -> None:
    """One decoder layer cut in place: q/k/v heads and gate/up columns kept, o and down over them.
    lora_shards: --fully-sharded-loras' (rank rows of A, output rows of a row layer's B), else None."""
    layer.cfg = local_cfg
    dense = layer.gate_up is not None  # an MoE layer's experts: tp_moe
    qkv = column_parallel(layer.qkv, heads)
    gate_up = column_parallel(layer.gate_up, (i_span, i_span)) if dense else None
    if lora_shards is None:
        layer.qkv, layer.o = qkv, RowParallelLinear(layer.o, heads[0], tp.rank, comm)
        if dense:
            layer.gate_up, layer.down = gate_up, RowParallelLinear(layer.down, i_span, tp.rank, comm)
        return
    ranks, h_span = lora_shards  # MoE bases are refused with them (tp_refusal)
    layer.qkv, layer.gate_up = ShardedColumnLora(qkv, ranks, comm), ShardedColumnLora(gate_up, ranks, comm)
    layer.o = ShardedRowLora(layer.o, heads[0], h_span, tp.rank, comm)
    layer.down = ShardedRowLora(layer.down, i_span, h_span, tp.rank, comm)


def shard_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], local_cfg: ModelConfig,
                    tp: TpGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rank's pool: the same blocks, its kv heads only ([blocks, block_size, Hkv / tp, D] per layer);
    layers that share a pool tensor (KV layer groups, server.engine.kv_groups) share their shard."""
    lo = tp.rank * local_cfg.num_kv_heads
    hi = lo + local_cfg.num_kv_heads
    shards: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, v in kv_caches:
        if id(k) not in shards:
            shards[id(k)] = (k[:, :, lo:hi].clone(), v[:, :, lo:hi].clone())
    return [shards[id(k)] for k, _ in kv_caches]


def worker_kv_caches(local_cfg: ModelConfig, blocks: int, block_size: int, cache_dtype: torch.dtype,
                     device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A worker's pool, laid out as rank 0's (allocate_kv_cache): per layer, its group place's tensors."""
    caches = kv_pool_like(local_cfg, blocks, block_size, cache_dtype, device)
    groups = local_cfg.kv_groups
    return caches if groups is None else [caches[slot] for slot in groups.layer_slot]
