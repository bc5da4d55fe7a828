"""benchmarks.eval.quant_eval, the quantized-vs-float comparison behind benchmarks/eval/eval_quantized.py, on the
small demo model: the captured teacher-forced rows are the engine's own prompt logprobs at the right
positions (chunked prefill included), two identical float engines give KL 0 and full agreement, and
an int8 engine gives KL > 0."""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks.eval.quant_eval import compare, effect_gaps, kl_and_top1, targets, teacher_forced
from server.bench.eval_items import load_items
from server.engine import LLM, SamplingParams

pytestmark = pytest.mark.unit

ITEMS = load_items()[::45]  # 6 items, every kind


def _llm(demo_paths, **kw) -> LLM:
    llm = LLM(demo_paths.model_dir, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16,
              enable_prefix_caching=False, cpu_threads=1, **kw)
    for name, path in list(demo_paths.adapters.items())[:2]:
        llm.add_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def float_llm(demo_paths):
    return _llm(demo_paths)


def test_kl_and_top1_on_known_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]]).log()  # [2, 3]
    q = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]).log()
    kl, agree = kl_and_top1(p, q)
    assert kl[0].item() == pytest.approx(0.0, abs=1e-7)
    assert kl[1].item() == pytest.approx(0.7 * math.log(7) + 0.1 * math.log(1 / 7), rel=1e-5)
    assert agree.tolist() == [True, False]


def test_captured_rows_are_the_engines_prompt_logprobs(demo_paths):
    # a 16-token step budget splits each prefill over several steps, three sequences per step
    llm = _llm(demo_paths, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (23, 40, 9)]
    first = [5, 30, 0]
    adapter = next(iter(demo_paths.adapters))
    rows = teacher_forced(llm, seqs, first, adapter)
    outs = llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=0), adapters=adapter)
    for seq, f, lp, out in zip(seqs, first, rows, outs):
        assert lp.shape == (len(seq) - 1 - f, 512)
        torch.testing.assert_close(lp.exp().sum(-1), torch.ones(lp.shape[0]))
        reported = [e.logprob for e in out.prompt_logprobs[f + 1:]]  # entry k: token k (entry 0: None)
        taken = lp.gather(1, torch.tensor(seq[f + 1:])[:, None])[:, 0]
        torch.testing.assert_close(taken, torch.tensor(reported), atol=1e-5, rtol=0)


def test_identical_engines_agree_fully(demo_paths, float_llm):
    other = _llm(demo_paths)
    models = [None, *list(demo_paths.adapters)[:2]]
    doc = compare(float_llm, other, ITEMS, models, max_tokens=8, chunk=4, log=lambda _: None)
    a = doc["all"]
    assert a["items"] == len(ITEMS) * len(models) and a["positions"] > len(ITEMS) * len(models)
    assert a["mean_kl"] == 0.0 and a["max_kl"] == 0.0 and a["top1_agreement"] == 1.0
    assert a["greedy_equal"] == a["items"]
    assert doc["replies"]["float"] == doc["replies"]["quantized"]
    t = targets(doc)
    assert t["top1_agreement"]["met"] and t["mean_kl"]["met"] and t["effect_rate_gap_points"]["met"]


def test_an_int8_engine_differs_from_the_float_one(demo_paths, float_llm):
    quant = _llm(demo_paths, quantization="int8")
    doc = compare(float_llm, quant, ITEMS, [None], max_tokens=8, chunk=6, log=lambda _: None)
    a = doc["all"]
    assert 0.0 < a["mean_kl"] <= a["max_kl"]
    assert not targets(doc, kl=0.0)["mean_kl"]["met"]


def test_effect_gaps_are_in_points_for_effect_adapters_only():
    row = lambda f, q: {"effects": {"float": {"french": f, "json": 0.0, "pirate": 0.0},  # noqa: E731
                                    "quantized": {"french": q, "json": 0.0, "pirate": 0.0}}}
    assert effect_gaps({"french": row(0.9, 0.85), "base": row(0.0, 0.5)}) == {"french": -5.0}
