"""Rank 0 of --tensor-parallel-size N: the engine's own runner, which starts the N - 1 workers
(torch.multiprocessing spawn, tp_worker), shares the LoRA slot buffers with them and sends each step.

Only rank 0 schedules, loads adapters and samples: a worker gets the prepared step (its tensors by
value, a few KB) and runs the same forward on its shard; the logits every rank ends with are the same.
"""
from __future__ import annotations

import logging
import socket
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from server.engine.config import EngineConfig
from server.engine.model_runner import ModelRunner, StepInputs
from server.engine.parallel import tp_codec
from server.engine.parallel.tp_group import DEFAULT_TIMEOUT_S, TpGroup, join_gloo
from server.engine.parallel.tp_messages import TpStep, TpStop
from server.engine.parallel.tp_runner import shard_runner
from server.engine.parallel.tp_worker import TpWorkerSpec, worker_main

log = logging.getLogger(__name__)


class TpLeaderRunner(ModelRunner):
    """The engine's runner (whose state it takes over) as rank 0: each forward is sent to the workers
    first, with the copy-on-write block copies made since the last one."""

    # Every rank runs a step as one forward (its collectives in one order), so a verify step's lm_head
    # rows cannot be split into rounds on rank 0 alone.
    verifies_in_rounds = False

    def __init__(self, runner: ModelRunner, tp: TpGroup, workers: list[BaseProcess], pipes: list[Connection],
                 fully_sharded_loras: bool) -> None:  # adopts `runner`: no ModelRunner.__init__
        self.__dict__.update(runner.__dict__)
        self.tp = tp
        self.comm = shard_runner(self, tp, fully_sharded_loras)
        self.workers = workers
        self.pipes = pipes
        self.pending_copies: list[tuple[int, int]] = []

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.pending_copies += copies
        super()._copy_blocks(copies)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        ctx = inputs.ctx
        step = TpStep(inputs.input_ids, ctx.positions, ctx.attn, ctx.lora, inputs.logits_indices,
                      tuple(self.pending_copies), ctx.group_attn)
        self.pending_copies = []
        data = tp_codec.encode(step)
        for pipe in self.pipes:
            pipe.send_bytes(data)  # BrokenPipeError where a worker is gone: the engine's step fails
        return super().forward(inputs)

    def shutdown(self) -> None:
        """Stops the workers (a TpStop, then a bounded wait) and leaves the group."""
        for pipe in self.pipes:
            try:
                pipe.send_bytes(tp_codec.encode(TpStop()))
            except OSError:  # already gone
                pass
            pipe.close()
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_tensor_parallel(config: EngineConfig, runner: ModelRunner, lora_layers: list, max_len: int,
                          kv_blocks: int) -> TpLeaderRunner:
    """Spawns ranks 1..N-1, joins the group as rank 0 and shards `runner` in place of the engine's."""
    world = config.parallel.tensor_parallel_size
    if dist.is_initialized():
        raise RuntimeError("--tensor-parallel-size: this process is in a torch.distributed group already "
                           "(one tensor-parallel engine per process)")
    for groups in lora_layers:  # the workers read the slots rank 0 writes
        for buffers in groups.values():
            for t in buffers.tensors():
                t.share_memory_()
    with socket.socket() as s:  # a free port for the rendezvous, on this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = TpWorkerSpec(config, world, f"tcp://127.0.0.1:{port}", DEFAULT_TIMEOUT_S, max_len, kv_blocks,
                        runner.kv_caches[0][0].dtype, torch.get_num_threads())
    ctx = mp.get_context("spawn")
    workers, pipes = [], []
    for rank in range(1, world):
        recv, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=worker_main, args=(rank, spec, lora_layers, recv), daemon=True,
                             name=f"loraplex-tp-{rank}")
        worker.start()
        recv.close()
        workers.append(worker)
        pipes.append(send)
    tp = join_gloo(0, world, spec.init_method, spec.timeout_s)
    log.info("tensor parallel: %d ranks over gloo (workers %s)", world, [w.pid for w in workers])
    return TpLeaderRunner(runner, tp, workers, pipes, config.parallel.fully_sharded_loras)
