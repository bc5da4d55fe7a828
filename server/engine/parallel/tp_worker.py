"""A tensor-parallel worker (ranks 1..N-1): its shard of the model and KV pool, and the step loop.

It loads the checkpoint itself and keeps its shard; the LoRA slot buffers are rank 0's, in shared
memory (CPU), so adapters rank 0 loads into a slot are there for the next step without a message.
Steps come over a pipe (a wait of any length), their collectives over the group (a timeout): when rank
0 goes the pipe ends and the worker exits; when a worker goes rank 0's next collective fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from server.engine.config import EngineConfig, ModelConfig
from server.engine.kernel_choice import select_kernels
from server.engine.model import StepContext
from server.engine.model_runner import copy_blocks
from server.engine.parallel.collectives import Collectives
from server.engine.parallel import tp_codec
from server.engine.parallel.tp_group import join_gloo
from server.engine.parallel.tp_messages import TpStep, TpStop
from server.engine.parallel.tp_model import TpCausalLM, worker_kv_caches
from server.engine.weights import served_model, served_weights


@dataclass(frozen=True)
class TpWorkerSpec:
    """What a worker needs besides its rank and the slot buffers: the engine's config and sizes."""

    config: EngineConfig
    world_size: int
    init_method: str
    timeout_s: float
    max_len: int  # the rope tables' positions (the engine's max_len at load)
    kv_blocks: int  # rank 0's pool: the same blocks, this rank's heads
    kv_dtype: torch.dtype  # rank 0's pool's (--kv-cache-dtype)
    threads: int


def worker_main(rank: int, spec: TpWorkerSpec, lora_layers: list, steps: Connection) -> None:
    """The spawned worker's body: join, build the shard, run steps until TpStop or rank 0 goes."""
    torch.set_num_threads(spec.threads)
    tp = join_gloo(rank, spec.world_size, spec.init_method, spec.timeout_s)
    config = spec.config
    device = torch.device("cpu")
    mcfg = ModelConfig.from_dir(config.model)
    dtype = config.device.resolve_dtype(mcfg, device)
    full = served_model(config, mcfg, served_weights(config, mcfg, dtype, device), lora_layers, spec.max_len)
    comm = Collectives(tp)
    model = TpCausalLM(full, tp, comm, config.parallel.fully_sharded_loras)
    del full  # the shard is cut: the full projections go
    kv_caches = worker_kv_caches(model.local_cfg, spec.kv_blocks, config.cache.block_size, spec.kv_dtype, device)
    ops = select_kernels(config.device.kernels, device, dtype)
    scratch = torch.empty(3, config.scheduler.max_num_batched_tokens, config.lora.max_lora_rank, dtype=dtype)
    while True:
        try:
            msg = tp_codec.decode(steps.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, TpStop):
            return
        assert isinstance(msg, TpStep), type(msg)
        if msg.block_copies:
            copy_blocks(kv_caches, msg.block_copies, device)
        ctx = StepContext(ops=ops, positions=msg.positions, attn=msg.attn, lora=msg.lora, lora_scratch=scratch,
                          group_attn=msg.group_attn)
        model.forward(msg.input_ids, kv_caches, ctx, msg.logits_indices)

