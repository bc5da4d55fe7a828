"""benchmarks/profile/gpu_profile_step.py's engine-facing parts on the CPU (the script itself needs CUDA): the
teacher-forced margin against transformers + peft, the graphed/eager comparison, the replay check catching a
graph that leaves other logits than its launches, and the final tables."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.profile import gpu_profile_step as gps
from benchmarks.profile.kernel_classes import kernel_report
from benchmarks.profile.token_divergence import MISMATCH, NEAR_TIE_NATS, ROUNDING, Generated
from server.engine import LLM
from server.engine.decode_graphs import PaddedOut
from tests.engine_helpers import random_prompts

VOCAB = 512
NAMES = (None, "r8_all", "r4_qv")


def _llm(model_dir, adapters, padded: bool = False, versions: dict[str, str] | None = None) -> LLM:
    """The tiny model on the CPU, two adapters (their version ids into `versions`), prefix caching off."""
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=64, max_model_len=128,
              max_num_batched_tokens=128, max_num_seqs=8, block_size=16, max_lora_rank=16, kernels="torch",
              enable_prefix_caching=False)
    for name in ("r8_all", "r4_qv"):
        version = llm.add_adapter(name, adapters[name])
        if versions is not None:
            versions[name] = version
    if padded:
        cfg = llm.engine.config
        llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len)
    return llm


def _batch() -> list[gps.Request]:
    return [gps.Request(tuple(p), name) for p, name in zip(random_prompts(len(NAMES), (5, 14), VOCAB, seed=3), NAMES)]


def test_a_divergence_is_classed_by_the_teacher_forced_margin(tiny_model_dir, tiny_adapters, hf_logprobs):
    llm = _llm(tiny_model_dir, tiny_adapters)
    requests = _batch()
    eager = gps.generate(llm, [requests], 4)
    assert all(len(g.tokens) == len(g.logprobs) == 4 for g in eager)
    same = gps.compare(llm, requests, eager, eager)
    assert (same["compared"], same["identical"], same["verdict"], same["divergences"]) == (3, 3, "identical", [])

    # request 1's third token swapped for another: the "graphed" engine chose it
    tokens = list(eager[1].tokens)
    alt = (tokens[2] + 1) % VOCAB
    graphed = list(eager)
    graphed[1] = Generated(tuple(tokens[:2] + [alt, 0]), eager[1].logprobs)
    c = gps.compare(llm, requests, graphed, eager)
    assert (c["compared"], c["identical"]) == (3, 2)
    (d,) = c["divergences"]
    assert (d["request"], d["position"], d["graphed_token"], d["eager_token"], d["adapter"], d["top_token"]) == \
        (1, 2, alt, tokens[2], "r8_all", tokens[2])
    ref = hf_logprobs("r8_all", list(requests[1].prompt) + tokens)[len(requests[1].prompt) + 1]
    assert d["gap"] == pytest.approx(float(ref.max() - ref[alt]), abs=1e-4)
    assert c["max_margin"] == d["gap"]
    assert (d["graphed_own_logprob"], d["eager_own_logprob"]) == (eager[1].logprobs[2], eager[1].logprobs[2])
    assert c["verdict"] == d["verdict"] == (ROUNDING if d["gap"] <= NEAR_TIE_NATS else MISMATCH)


class _ZeroLogitsGraph:
    """A 'captured graph' whose replay leaves logits its launches would not: what the replay check must catch."""

    def replay(self) -> None:
        pass


def test_the_replay_check_catches_a_graph_that_differs_from_its_launches(tiny_model_dir, tiny_adapters):
    batches = [[gps.Request(r.prompt, "r8_all") for r in _batch()]]  # 3 adapter rows: bucket 4 with LoRA
    plain = _llm(tiny_model_dir, tiny_adapters, padded=True)
    assert gps.replay_check(plain, batches, [], 3) == {"compared": 0, "bit_identical": 0,
                                                       "skipped": "no captured graphs"}
    padded = plain.engine.runner.padded
    padded.graphs[4, True, False] = (_ZeroLogitsGraph(), PaddedOut(torch.zeros(4, VOCAB), None))
    graphed = gps.generate(plain, batches, 3)
    assert padded.replays == 2  # the two decode steps replayed it (the first token is the prefill's)
    check = gps.replay_check(plain, batches, graphed, 3)
    assert {k: check[k] for k in ("compared", "bit_identical", "differing_requests")} == \
        {"compared": 3, "bit_identical": 0, "differing_requests": [0, 1, 2]}
    # the zero logits' token 0 from the first decode step on; the prefill's token and logprob agree
    assert (check["same_tokens"], check["max_logprob_drift"]) == (0, 0.0)
    assert padded.replays == 2 and padded.graphs  # graphs_off ran eagerly and gave the graph back


def _point(seqs: int, adapters: int, graphs: bool, ok: bool = True) -> dict:
    kernels = [("_bgmv_shrink_kernel", 20.0), ("nvjet_a", 100.0)] * 3
    point = {"seqs": seqs, "adapters": adapters, "step_ms": 9.0 if graphs else 25.0, "replayed_steps": 20,
             "host_launches": 9.0, "device_kernels": 2.0, "device_time": kernel_report(kernels, 3)}
    if graphs:
        point.update(replay_ms=7.5, padded_eager={"compared": 128, "bit_identical": 128 if ok else 127})
    return point


def test_tables_and_graph_bugs(capsys):
    report = {"graphed": {"cuda_graphs": 39, "capture_seconds": 5.7, "capture_mib": 1572.0,
                          "points": [_point(64, 8, True), _point(256, 0, True, ok=False)]},
              "eager": {"points": [_point(64, 8, False), _point(256, 0, False)]},
              "comparison": {"64x8": {"compared": 128, "identical": 120, "max_margin": 0.012, "verdict": ROUNDING},
                             "256x0": {"compared": 256, "identical": 256, "max_margin": None, "verdict": "identical"}}}
    gps.print_tables(report)
    out = capsys.readouterr().out
    assert "128/128" in out and "127/128" in out and "0.0120 rounding" in out
    assert "_bgmv_shrink_kernel 0.02 ms x1" in out
    assert gps.graph_bugs(report) == ["256x0"]


def test_steady_point_runs_its_steps_and_profile(tiny_model_dir, tiny_adapters, monkeypatch):
    """The timing and profile path, CUDA synchronization made a no-op: the point's fields (no kernels on a CPU)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    versions: dict[str, str] = {}
    llm = _llm(tiny_model_dir, tiny_adapters, padded=True, versions=versions)
    args = gps.argparse.Namespace(steps=2)
    point = gps.steady(llm, versions, _batch(), args)
    assert point["replayed_steps"] == 0 and "replay_ms" not in point  # nothing captured on a CPU
    assert point["step_ms"] > 0 and point["device_kernels"] == 0
    assert [c["us_per_step"] for c in point["device_time"]["classes"]] == [0.0] * 6
    assert not llm.engine.has_unfinished_requests()


def test_main_end_to_end_on_the_cpu(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The whole script's wiring, CUDA stood in for by the CPU and the tiny model: two engines, every
    point's line, the JSON and the tables; the graphed engine pads its decode steps (no graphs to capture
    on a CPU, so its replay check is skipped) and gives the eager engine's tokens."""
    for name, value in (("synchronize", lambda *a: None), ("empty_cache", lambda: None),
                        ("get_device_name", lambda *a: "cpu")):
        monkeypatch.setattr(torch.cuda, name, value)
    real = gps.LLM

    def on_cpu(model, **kw) -> LLM:
        llm = real(model, **{**kw, "device": "cpu", "dtype": "float32", "kv_cache_blocks": 64, "max_model_len": 128,
                             "kernels": "torch"})
        if not kw["enforce_eager"]:
            cfg = llm.engine.config
            llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs,
                                                cfg.scheduler.max_model_len)
        return llm

    monkeypatch.setattr(gps, "LLM", on_cpu)
    monkeypatch.setattr(gps, "make_llama3_8b_shaped", lambda *a, **kw: tiny_model_dir)
    out = tmp_path / "profile.json"
    rc = gps.main(["--seqs", "3", "--adapters", "0", "2", "--steps", "2", "--identity-tokens", "3", "--prompt-len",
                   "8", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(p["seqs"], p["adapters"]) for p in doc["eager"]["points"]] == [(3, 0), (3, 2)]
    assert doc["tokens_identical"] == {"3x0": True, "3x2": True}
    assert doc["comparison"]["3x2"]["compared"] == 6  # with adapters, the mixed-base generation too
    assert doc["graphed"]["points"][1]["padded_eager"]["skipped"] == "no captured graphs"
    assert printed.count('"graphs": true') == printed.count('"graphs": false') == 2
    rows = [line.split() for line in printed.splitlines()]
    assert ["3", "2"] in [r[:2] for r in rows if r[-1:] == ["identical"]]  # the main table's row and verdict
