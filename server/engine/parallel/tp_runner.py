"""An engine's model runner turned into one tensor-parallel rank's, in place."""
from __future__ import annotations

from server.engine.model_runner import ModelRunner
from server.engine.parallel.collectives import Collectives
from server.engine.parallel.tp_group import TpGroup
from server.engine.parallel.tp_model import TpCausalLM, shard_kv_caches


def shard_runner(runner: ModelRunner, tp: TpGroup, fully_sharded_loras: bool = False) -> Collectives:
    """runner's model and KV pool become this rank's shards (before any step: the pool must be empty);
    the collectives its forward makes, metered, are returned. Every rank must then run the same steps
    in the same order: the same scheduler over the same requests (SPMD), or the steps rank 0 sends."""
    assert runner.padded is None, "padded decode (CUDA graphs) is not sharded"
    comm = Collectives(tp)
    model = TpCausalLM(runner.model, tp, comm, fully_sharded_loras)
    runner.model = model
    runner.kv_caches[:] = shard_kv_caches(runner.kv_caches, model.local_cfg, tp)  # the list others hold too
    return comm
