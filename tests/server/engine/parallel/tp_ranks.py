"""What each rank of a test's tensor-parallel group runs (spawned: importable by module name)."""
from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from server.engine import LLM, SamplingParams
from server.engine.parallel.tp_group import join_gloo
from server.engine.parallel.tp_runner import shard_runner


@dataclass(frozen=True)
class TpJob:
    """One mixed batch to generate at TP = world_size, every request added before the first step."""

    init_method: str
    model_dir: str
    adapters: dict[str, str]  # name -> adapter dir, added in this order on every rank
    prompts: list[list[int]]
    names: list[str | None]
    max_tokens: int
    fully_sharded_loras: bool = False  # A by rank rows too (sharded_lora)


@dataclass(frozen=True)
class TpResult:
    rank: int
    tokens: list[list[int]] | None
    logprobs: list[list[float]] | None  # each generated token's own logprob
    comm_bytes: dict[str, int]
    comm_calls: dict[str, int] | None = None
    error: str | None = None


def build_llm(job: TpJob) -> LLM:
    # Max rank 16: the rank-16 adapter's rows split 8 / 8 under --fully-sharded-loras.
    llm = LLM(job.model_dir, device="cpu", dtype="float32", max_loras=4, max_lora_rank=16, kv_cache_blocks=128,
              max_model_len=256)
    for name, path in job.adapters.items():
        llm.add_adapter(name, path)
    return llm


def generate(llm: LLM, job: TpJob) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=job.max_tokens, logprobs=0)
    outs = llm.generate(job.prompts, params, adapters=job.names)
    return ([o.token_ids for o in outs],
            [[lp.logprob for lp in o.logprobs] for o in outs])


def run_rank(rank: int, world_size: int, job: TpJob, results) -> None:
    """Joins the group, builds the same engine as every rank, shards its runner and generates."""
    torch.set_num_threads(1)
    try:
        tp = join_gloo(rank, world_size, job.init_method, timeout_s=120)
        llm = build_llm(job)
        comm = shard_runner(llm.engine.runner, tp, job.fully_sharded_loras)
        tokens, logprobs = generate(llm, job)
        results.put(TpResult(rank, tokens, logprobs, dict(comm.bytes), dict(comm.calls)))
    except Exception:  # the parent asserts on it
        results.put(TpResult(rank, None, None, {}, traceback.format_exc()))
