"""Speculative verify steps padded to (row bucket, k + 1) shapes and run from the persistent decode buffers
(server.engine.decode_graphs), checked on the CPU against the eager verify path: greedy tokens identical
and logprobs within 1e-4 (float32), for mixed batches of base rows and several adapters, rows with fewer
drafts than the widest (padding tokens), and a bucket first run with one adapter active and later with
more. On CUDA the same contexts are captured as graphs (the GPU test, skipped without one)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from server.engine import LLM, SamplingParams
from server.engine.engine_startup import verify_shapes
from tests.server.engine.test_engine_padded_decode import LaunchLog, _forbid_host_sync

pytestmark = pytest.mark.unit
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="Triton needs a GPU or the interpreter")

VOCAB = 512
TOL = 1e-4
K = 3
ADAPTERS = ("r4_qv", "r8_all", "r16_rslora")
METHODS = {
    "draft_model": lambda model_dir: {"method": "draft_model", "model": str(model_dir)},
    "ngram": lambda model_dir: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
}


def make_llm(model_dir, adapters, method: str, padded: bool, device: str = "cpu", kernels: str = "torch",
             **kw) -> LLM:
    spec = {**METHODS[method](model_dir), "num_speculative_tokens": K, "disable_by_batch_size": 64}
    llm = LLM(model_dir, device=device, dtype="float32", max_loras=4, kv_cache_blocks=96, max_model_len=128,
              max_num_batched_tokens=128, max_num_seqs=8, block_size=16, max_lora_rank=16, kernels=kernels,
              speculative_config=spec, **kw)
    for name in ADAPTERS:
        llm.add_adapter(name, adapters[name])
    if padded:
        pad_steps(llm, device)
    return llm


def pad_steps(llm: LLM, device: str = "cpu") -> None:
    """Decode and verify steps padded from now on, as the engine pads them on CUDA (engine_startup.verify_shapes)."""
    cfg = llm.engine.config
    llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len,
                                        *verify_shapes(cfg, torch.device(device), cfg.scheduler.max_num_seqs))


def prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts that repeat their own start: prompt lookup finds drafts, of varying counts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        head = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 12))]
        out.append(head + head[: rng.randint(2, len(head))])
    return out


def run(llm: LLM, batch: list[list[int]], names: list[str | None]):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate(batch, params, adapters=names)


def assert_close(outs, refs) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        for a, b in zip(out.logprobs, ref.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL


# Triton (the interpreter on a CPU) with prompt lookup only: its rows have varying draft counts, so
# padding inside rows; a draft model always drafts k.
@pytest.mark.parametrize("method,kernels", [("draft_model", "torch"), ("ngram", "torch"),
                                            pytest.param("ngram", "triton", marks=needs_triton)])
def test_padded_verify_matches_the_eager_verify_path(tiny_model_dir, tiny_adapters, monkeypatch, method, kernels):
    """With the Triton kernels, also: every verify step of one shape launches the same (grids, scalar
    arguments, metadata addresses: what a captured graph replays), whatever its rows, adapters and
    context lengths."""
    padded = make_llm(tiny_model_dir, tiny_adapters, method, padded=True, kernels=kernels)
    eager = make_llm(tiny_model_dir, tiny_adapters, method, padded=False, kernels=kernels)
    launches = _log_verify_launches(padded, LaunchLog(monkeypatch)) if kernels == "triton" else None
    # First one adapter and base rows, then three adapters in the same buckets (a different active count).
    batches = [(prompts(3, seed=1), ["r8_all", None, "r8_all"]),
               (prompts(5, seed=2), ["r4_qv", None, "r16_rslora", "r8_all", None]),
               (prompts(2, seed=3), [None, None])]
    for batch, names in batches:
        assert_close(run(padded, batch, names), run(eager, batch, names))
    runner = padded.engine.runner
    assert runner.padded.verify_steps > 0, "no verify step ran padded: the test shows nothing"
    assert eager.engine.runner.padded is None
    counters = padded.engine.scheduler.spec_counters.snapshot()
    assert counters.num_accepted_tokens > 0 and counters.num_drafts > 0
    if launches is not None:
        assert any(len(steps) > 1 for steps in launches.values()), launches.keys()
        for key, steps in launches.items():
            assert all(step == steps[0] for step in steps), key


def _log_verify_launches(llm: LLM, log: LaunchLog) -> dict[tuple, list[list[tuple]]]:
    """(bucket, LoRA, DoRA) key -> the launches of each verify step run with it, from now on."""
    padded = llm.engine.runner.padded
    stage_verify, run_key = padded.stage_verify, padded.run
    by_key: dict[tuple, list[list[tuple]]] = {}
    verify: list[tuple] = []

    def staged(*args):
        verify.append(stage_verify(*args))
        return verify[-1]

    def ran(key):
        log.take()
        logits = run_key(key)
        if verify and verify.pop() == key:
            by_key.setdefault(key, []).append(log.take())
        return logits

    padded.stage_verify, padded.run = staged, ran
    return by_key


def test_padded_verify_forward_reads_nothing_back_to_the_host(tiny_model_dir, tiny_adapters, monkeypatch):
    """No host sync inside a padded verify step's forward (what CUDA graph capture needs)."""
    llm = make_llm(tiny_model_dir, tiny_adapters, "draft_model", padded=True)
    padded = llm.engine.runner.padded
    stage_verify, run_key = padded.stage_verify, padded.run
    guarded = [False]
    checked: list[tuple] = []

    def staged(*args):
        guarded[0] = True
        return stage_verify(*args)

    def ran(key):
        try:
            logits = run_key(key)
        finally:
            if guarded[0]:
                checked.append(key)
            guarded[0] = False
        return logits

    padded.stage_verify, padded.run = staged, ran
    _forbid_host_sync(monkeypatch, allowed=lambda: not guarded[0])
    outs = run(llm, prompts(3, seed=4), ["r8_all", None, "r16_rslora"])
    monkeypatch.undo()
    assert checked and all(len(o.token_ids) == 12 for o in outs)


def test_verify_shapes_share_token_buckets_and_stay_within_the_workspace(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir, tiny_adapters, "ngram", padded=True)
    padded = llm.engine.runner.padded
    assert padded.buckets == (1, 2, 4, 8)
    assert padded.verify_widths == (2, 3, 4)
    assert padded.sizes == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # row bucket x width, decode's included
    assert padded.verify_bucket(3, 4) == 4 and padded.verify_bucket(8, 4) == 8
    assert padded.verify_bucket(3, 5) is None and padded.verify_bucket(9, 2) is None  # eager
    assert {key[0] for key in padded.contexts} == set(padded.sizes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("method", list(METHODS))
def test_captured_verify_graphs_match_the_eager_verify_path_on_cuda(tiny_model_dir, tiny_adapters, method):
    """The engine captures the verify shapes at start (engine_startup.verify_shapes) and replays them."""
    graphs = make_llm(tiny_model_dir, tiny_adapters, method, padded=False, device="cuda", kernels="triton")
    eager = make_llm(tiny_model_dir, tiny_adapters, method, padded=False, device="cuda", kernels="triton",
                     enforce_eager=True)
    assert eager.engine.runner.padded is None
    for batch, names in [(prompts(3, seed=1), ["r8_all", None, "r8_all"]),
                         (prompts(5, seed=2), ["r4_qv", None, "r16_rslora", "r8_all", None])]:
        assert_close(run(graphs, batch, names), run(eager, batch, names))
    padded = graphs.engine.runner.padded
    assert padded.verify_widths == tuple(range(2, K + 2)) and padded.verify_steps > 0
    stats = padded.stats()
    assert stats.graphs == 3 * len(padded.sizes) and stats.replays >= padded.verify_steps
