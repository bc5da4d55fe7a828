"""The forward's activation buffers: allocated once at the step's maximum size, reused by every layer.

Why: on CPU a fresh prefill-sized output costs page faults on every layer. glibc serves blocks over
32 MB straight from mmap, so each one is new, unmapped memory. A 4096-token gate_up output of the
smol135 shape (50 MB) took 97 ms into a new tensor and 80 ms into a reused one (2 threads); at 8B
widths every projection's output is over that size. Layers run one after another, so one set of
buffers serves all of them: a layer's outputs are consumed before the next layer writes its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.config import ModelConfig


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
