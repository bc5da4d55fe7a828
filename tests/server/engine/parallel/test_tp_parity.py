"""TP = 2 on gloo (two spawned processes) generates the same greedy tokens as TP = 1 and as transformers
+ peft in float32, logprobs within 1e-4, for a mixed batch of base rows, two LoRA adapters of different
ranks and two DoRA ones; LoRA sharded as vLLM does by default (tp_layers) and fully (sharded_lora)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch.multiprocessing as mp

from tests.engine_helpers import random_prompts
from tests.server.engine.parallel.tp_ranks import TpJob, build_llm, generate, run_rank
from tests.server.engine.parallel.tp_serving import peft_logprobs

WORLD = 2
TOKENS = 6


def run_tp(job: TpJob, world_size: int) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world_size, job, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    got = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r.rank)
    for p in procs:
        p.join(timeout=60)
    for r in got:
        assert r.error is None, r.error
    return got


@pytest.fixture(scope="module")
def job(tiny_model_dir, every_adapter, tmp_path_factory) -> TpJob:
    adapters = {name: str(every_adapter[name]) for name in ("r8_all", "r16_rslora", "dora_r8_all", "dora_r16_pattern")}
    names = [None, "r8_all", "r16_rslora", "dora_r8_all", None, "r16_rslora", "dora_r16_pattern", "dora_r8_all"]
    init = f"file://{tmp_path_factory.mktemp('tp-rendezvous') / 'store'}"
    return TpJob(init, str(tiny_model_dir), adapters, random_prompts(len(names), (3, 30), 512, seed=3), names, TOKENS)


@pytest.fixture(scope="module")
def every_adapter(tiny_adapters, tiny_dora_adapters) -> dict:
    return {**tiny_adapters, **tiny_dora_adapters}


# The default sharding's ranks are the engine's in test_tp_engine (against TP = 1, and transformers + peft in
# test_tp2_dora_matches_peft and the paged test), which also counts both modes' collectives.
@pytest.mark.parametrize("fully_sharded", [True], ids=["fully-sharded"])
def test_tp2_matches_tp1_and_peft(job, fully_sharded, tiny_model_dir, every_adapter, peft_oracle, tmp_path):
    job = replace(job, init_method=f"file://{tmp_path / 'store'}", fully_sharded_loras=fully_sharded)
    ranks = run_tp(job, WORLD)
    tp1_tokens, tp1_logprobs = generate(build_llm(job), job)
    for r in ranks:  # every rank samples the same gathered logits
        assert r.tokens == tp1_tokens
        assert r.comm_bytes["all_reduce"] > 0 and r.comm_bytes["all_gather"] > 0
        # Fully sharded: a gather of the shrink per column layer (2 a layer) beside the logits' one per step.
        assert (2 * r.comm_calls["all_gather"] > r.comm_calls["all_reduce"]) == fully_sharded
        for got, want in zip(r.logprobs, tp1_logprobs):
            assert got == pytest.approx(want, abs=1e-4)
    for prompt, name, tokens, logprobs in zip(job.prompts, job.names, ranks[0].tokens, ranks[0].logprobs):
        adapter = every_adapter[name] if name else None
        assert tokens == peft_oracle(tiny_model_dir, adapter, prompt, TOKENS), name
        assert logprobs == pytest.approx(peft_logprobs(tiny_model_dir, adapter, prompt, tokens), abs=1e-4), name
