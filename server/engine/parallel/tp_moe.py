"""An MoE block (server.engine.moe_block) cut for one tensor-parallel rank: every expert's intermediate
columns split as a dense MLP's are (gate and up column-parallel, down row-parallel), the router
replicated (each rank routes the same all_reduced hidden rows alike), the block's partial output summed
by one all_reduce of [T, H].

Expert LoRA as the dense layers' default sharding: gate_up's A whole and B's columns for the rank's gate
and up columns (two views of the shared slot buffer, so rank 0's loads show through: the fused [.., 2I]
B has no single view of both halves, hence two applications, each with the shrink); down's A by the
rank's input columns and B whole, its partial delta riding the block's all_reduce. The routing weights
and the scatter-add over tokens are linear, so the ranks' partial outputs sum to TP = 1's.
"""
from __future__ import annotations

import torch

from kernels.expert_batch import ExpertBatch
from server.engine.config import ModelConfig
from server.engine.lora.expert_buffers import ExpertLoraBuffers
from server.engine.moe_block import MoeBlock
from server.engine.parallel.collectives import Collectives


class TpMoeBlock(MoeBlock):
    """A built MoeBlock (whose state it takes over) on this rank's expert columns i_span."""

    def __init__(self, block: MoeBlock, local_cfg: ModelConfig, i_span: tuple[int, int], comm: Collectives) -> None:  # adopts `block`
        self.__dict__.update(block.__dict__)
        lo, hi = i_span
        inter = block.cfg.moe_intermediate_size
        self.cfg = local_cfg
        self.comm = comm
        # [E, 2 I / tp, H]: this rank's gate rows then its up rows.
        self.gate_up = torch.cat([block.gate_up[:, lo:hi], block.gate_up[:, inter + lo:inter + hi]], dim=1)
        self.down = block.down[:, :, lo:hi].contiguous()  # [E, H, I / tp]
        lora = block.gate_up_lora
        self.gate_lora = ExpertLoraBuffers(lora.a, lora.b[..., lo:hi], lora.scaling)
        self.up_lora = ExpertLoraBuffers(lora.a, lora.b[..., inter + lo:inter + hi], lora.scaling)
        down = block.down_lora
        self.down_lora = ExpertLoraBuffers(down.a[..., lo:hi], down.b, down.scaling)

    def gate_and_up(self, xs: torch.Tensor, batch: ExpertBatch, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.cfg.moe_intermediate_size
        return (self._experts(xs, self.gate_up[:, :local], self.gate_lora, batch, ctx),
                self._experts(xs, self.gate_up[:, local:], self.up_lora, batch, ctx))

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return self.comm.all_reduce(super().__call__(x, ctx))
