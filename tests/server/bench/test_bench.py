"""The bench: workload statistics, metrics, and short real runs that write JSON and PNG."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from server.bench.metrics import RequestRecord, percentile, summarize
from server.bench.workload import (WorkloadConfig, WorkloadError, adapters_used, generate_workload,
                                   tenant_of_adapter)


def _gaps(reqs):
    times = [r.arrival_s for r in reqs]
    return [b - a for a, b in zip([0.0] + times, times)]


@pytest.mark.parametrize("cv", [1.0, 2.0, 0.5])
def test_arrivals_have_the_asked_rate_and_cv(cv):
    reqs = generate_workload(WorkloadConfig(num_adapters=4, num_requests=20000, rate=5.0, cv=cv,
                                            prompt_len=(1, 1), output_len=(1, 1), seed=3))
    gaps = _gaps(reqs)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 5.0, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.08)
    assert all(g >= 0 for g in gaps)


def test_duration_gives_rate_times_duration_requests_and_inf_rate_is_a_burst():
    reqs = generate_workload(WorkloadConfig(num_adapters=4, duration_s=30.0, rate=4.0, seed=1))
    assert len(reqs) == 120
    burst = generate_workload(WorkloadConfig(num_adapters=4, num_requests=10, seed=1))
    assert [r.arrival_s for r in burst] == [0.0] * 10


def test_popularity_follows_the_power_law():
    n, total = 64, 20000
    uniform = generate_workload(WorkloadConfig(num_adapters=n, num_requests=total, prompt_len=(1, 1), seed=5))
    counts = [0] * n
    for r in uniform:
        counts[r.adapter] += 1
    assert min(counts) > 0.6 * total / n and max(counts) < 1.4 * total / n  # alpha = 1: uniform

    skewed = generate_workload(WorkloadConfig(num_adapters=n, num_requests=total, alpha=0.1, prompt_len=(1, 1),
                                              seed=5))
    share0 = sum(r.adapter == 0 for r in skewed) / total
    assert share0 == pytest.approx(n ** -0.1, abs=0.02)          # P(u < 1/n) = (1/n)^alpha
    first_half = sum(r.adapter < n // 2 for r in skewed) / total
    assert first_half == pytest.approx(0.5 ** 0.1, abs=0.01)
    last = sum(r.adapter == n - 1 for r in skewed) / total        # 1 - ((n-1)/n)^alpha, about 0.16%
    assert last == pytest.approx(1 - ((n - 1) / n) ** 0.1, abs=0.001) and last < counts[n - 1] / total / 5


def test_seeded_lengths_tenants_and_base_share():
    cfg = WorkloadConfig(num_adapters=8, num_requests=400, prompt_len=(3, 9), output_len=(2, 5), num_tenants=3,
                         base_share=0.25, token_range=(3, 50), seed=11)
    a, b = generate_workload(cfg), generate_workload(cfg)
    assert a == b
    assert a != generate_workload(WorkloadConfig(**{**cfg.__dict__, "seed": 12}))
    assert all(3 <= len(r.prompt_ids) <= 9 and 2 <= r.max_tokens <= 5 for r in a)
    assert all(3 <= t < 50 for r in a for t in r.prompt_ids)
    assert {len(r.prompt_ids) for r in a} == set(range(3, 10))
    for r in a:
        if r.adapter is not None:
            assert r.tenant == tenant_of_adapter(r.adapter, 3) and r.adapter_name.startswith("bench-a")
    assert sum(r.adapter is None for r in a) / len(a) == pytest.approx(0.25, abs=0.06)


@pytest.mark.parametrize("kw, needle", [
    (dict(num_adapters=4), "exactly one"),
    (dict(num_adapters=4, duration_s=10.0), "finite rate"),
    (dict(num_adapters=4, num_requests=5, alpha=0.0), "alpha"),
    (dict(num_adapters=4, num_requests=5, prompt_len=(5, 2)), "prompt_len"),
    (dict(num_adapters=4, num_requests=5, cv=-1.0), "cv"),
])
def test_bad_workloads_are_refused_with_a_reason(kw, needle):
    with pytest.raises(WorkloadError, match=needle):
        WorkloadConfig(**kw)


def test_output_agreement_counts_requests_both_sides_completed():
    from server.bench.metrics import RequestRecord, agreement, output_digests

    def rec(i, text, ok=True):
        r = RequestRecord(i, "t", None, 0.0, 4, 2, text=text)
        if ok:
            r.first_token_s, r.end_s = 0.1, 0.2
        return r

    mine = output_digests([rec(0, "ab"), rec(1, "cd"), rec(2, "ef"), rec(3, "gh", ok=False)])
    theirs = output_digests([rec(0, "ab"), rec(1, "cx"), rec(2, "ef", ok=False), rec(3, "gh")])
    assert mine[3] is None and theirs[2] is None and mine[0] == theirs[0] != mine[1]
    assert agreement(mine, theirs) == {"compared": 2, "same": 1}
    assert agreement(None, theirs) is None


def test_percentiles_and_summary():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    recs = []
    for i in range(10):
        r = RequestRecord(i, "t0" if i < 5 else "t1", "a", arrival_s=0.0, prompt_tokens=4, expected_tokens=3)
        r.token_times_s = [i + 1.0, i + 1.5, i + 2.0]
        r.first_token_s, r.end_s, r.output_tokens = i + 1.0, i + 2.0, 3
        recs.append(r)
    recs.append(RequestRecord(10, "t1", "a", 0.0, 4, 3, error="HTTP 500"))
    s = summarize(recs, ttft_slo_s=5.0)
    assert s["completed"] == 10 and s["failed"] == 1 and s["duration_s"] == 11.0
    assert s["throughput_tok_s"] == pytest.approx(30 / 11.0)
    assert s["ttft_s"]["p50"] == pytest.approx(5.5) and s["itl_s"]["p99"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(5 / 11)  # ttft 1..5 meet 5 s; the failure counts against
    assert s["per_tenant"]["t0"]["slo_attainment"] == 1.0
    assert s["per_tenant"]["t1"]["slo_attainment"] == 0.0 and s["per_tenant"]["t1"]["requests"] == 6


def test_engine_target_and_baseline_produce_every_token(tiny_model_dir, tmp_path):
    from server.bench.baseline import BaselineConfig, PeftBaseline
    from server.bench.engine_target import EngineTarget
    from server.bench.synth_adapters import ensure_adapters
    from server.bench.workload import adapter_name

    reqs = generate_workload(WorkloadConfig(num_adapters=3, num_requests=8, base_share=0.25, prompt_len=(2, 9),
                                            output_len=(2, 6), rate=200.0, seed=2))
    dirs = ensure_adapters(tiny_model_dir, tmp_path, adapters_used(reqs), r=4)
    named = {adapter_name(i): d for i, d in dirs.items()}
    for target in (EngineTarget(tiny_model_dir, named, device="cpu", dtype="float32", max_loras=3,
                                max_lora_rank=4, kernels="torch"),
                   PeftBaseline(tiny_model_dir, named, BaselineConfig(max_batch=4))):
        records = target.run(reqs)
        assert all(rec.ok for rec in records), [rec.error for rec in records]
        assert [rec.output_tokens for rec in records] == [r.max_tokens for r in reqs]
        assert all(rec.first_token_s >= rec.arrival_s and rec.end_s >= rec.first_token_s for rec in records)


def test_cli_run_against_the_demo_model_writes_json_and_png(demo_paths, tmp_path, capsys):
    """The minimum interface, end to end: a `loraplex serve` child over HTTP, then peft."""
    from server.bench.cli import main

    out = tmp_path / "bench.json"
    rc = main(["--adapters", "1,3", "--requests", "6", "--prompt-len", "4:12", "--output-len", "3:6",
               "--tenants", "2", "--compare-peft", "--model", str(demo_paths.model_dir), "--json", str(out),
               "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [p["num_adapters"] for p in doc["points"]] == [1, 3]
    for p in doc["points"]:
        lp, bl = p["loraplex"], p["baseline"]
        assert lp["completed"] == bl["completed"] == 6, (lp["errors"], bl["errors"])
        assert lp["output_tokens"] == bl["output_tokens"] > 0     # ignore_eos: the same work on both sides
        assert p["throughput_ratio_vs_peft"] == pytest.approx(lp["throughput_tok_s"] / bl["throughput_tok_s"])
        assert lp["ttft_s"]["p50"] > 0 and set(lp["per_tenant"]) <= {"bench-t000", "bench-t001"}
        digests = p["loraplex_output_digests"]  # the streamed texts, to compare with a peer's
        assert len(digests) == 6 and None not in digests and len(set(digests)) > 1
        assert p["outputs_vs_peft"] == {"compared": 6, "same": 6}  # greedy float32: PEFT's text exactly
    assert doc["throughput_ratio_vs_peft"] == doc["points"][-1]["throughput_ratio_vs_peft"]
    assert math.isfinite(doc["throughput_ratio_vs_peft"])
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "text = peft 6/6" in capsys.readouterr().out


# ---- the prefix workload: system prompts per tenant, multi-turn history, cache off and on ----

def test_conversations_resend_their_history_after_the_tenants_system_prompt():
    from server.bench.workload import generate_conversations

    cfg = WorkloadConfig(num_adapters=4, num_requests=10, rate=2.0, prompt_len=(5, 5), output_len=(3, 4),
                         num_tenants=2, base_share=0.25, shared_prefix_len=12, turns=3, turn_gap_s=0.5, seed=4)
    reqs = generate_conversations(cfg)
    assert reqs == generate_conversations(cfg) and len(reqs) == 10
    assert [r.index for r in reqs] == list(range(10))
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    system = {}
    for r in reqs:
        assert system.setdefault(r.tenant, r.prompt_ids[:12]) == r.prompt_ids[:12]  # one system prompt per tenant
    assert len(set(system.values())) == 2
    assert sorted(r.turn for r in reqs) == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]  # 3 + 3 + 3 turns, then 1
    firsts = [r for r in reqs if r.turn == 0]
    for first in firsts:
        chain = [first]
        for r in reqs:  # the next turn extends the last prompt by the reply and a new message
            last = chain[-1]
            if r.turn == last.turn + 1 and r.prompt_ids[:len(last.prompt_ids)] == last.prompt_ids:
                assert len(r.prompt_ids) == len(last.prompt_ids) + last.max_tokens + 5
                assert r.arrival_s == pytest.approx(last.arrival_s + 0.5)
                assert (r.tenant, r.adapter) == (first.tenant, first.adapter)
                chain.append(r)
        assert len(first.prompt_ids) == 12 + 5
        assert len(chain) == (3 if first is not firsts[-1] else 1)
    with pytest.raises(WorkloadError, match="turns"):
        WorkloadConfig(num_adapters=1, num_requests=1, turns=0)


def test_prefix_workload_runs_the_engine_with_the_cache_off_and_on(tiny_model_dir, tmp_path, capsys):
    from server.bench.cli import main

    out = tmp_path / "prefix.json"
    rc = main(["--workload", "prefix", "--adapters", "2", "--requests", "9", "--shared-prefix", "48",
               "--prompt-len", "16:16", "--output-len", "3:5", "--turns", "3", "--turn-gap", "0.3", "--rate", "10",
               "--tenants", "2", "--rank", "4", "--model", str(tiny_model_dir), "--json", str(out),
               "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["workload"] == "prefix" and doc["config"]["shared_prefix_len"] == 48
    (point,) = doc["points"]
    off, on = point["cache_off"], point["cache_on"]
    assert off["completed"] == on["completed"] == point["requests"] == 9, (off["errors"], on["errors"])
    assert point["outputs_identical"] and point["identical_outputs"] == 9  # greedy: the cache changes no token
    assert off["prefix_cache"] == {"enabled": False, "queries_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0,
                                   "cached_free_blocks_at_end": 0}
    # Turns after the first of each adapter reuse the 3 system-prompt blocks, later turns their history too.
    assert point["hit_rate"] == on["prefix_cache"]["hit_rate"] > 0.5
    assert set(on["ttft_p50_by_turn_s"]) == {"0", "1", "2"}
    assert point["ttft_p50_ratio_off_over_on"] == pytest.approx(off["ttft_s"]["p50"] / on["ttft_s"]["p50"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "hit rate" in printed and "outputs identical 9/9" in printed


def test_prefix_workload_needs_the_engine_target():
    from server.bench.runner import BenchConfig, BenchConfigError

    with pytest.raises(BenchConfigError, match="--target engine"):
        BenchConfig(workload_type="prefix", target="http")
    with pytest.raises(BenchConfigError, match="--workload"):
        BenchConfig(workload_type="burst")


def _round(tok_s: float, ratio: float | None = None) -> dict:
    return {"num_adapters": 8, "loraplex": {"throughput_tok_s": tok_s}, "throughput_ratio_vs_peft": ratio}


def test_rounds_report_the_median_round_and_median_paired_ratios():
    from server.bench.rounds import combine_rounds, round_order, scaling_vs_fewest

    assert round_order((1, 8, 32), 0) == (1, 8, 32) and round_order((1, 8, 32), 1) == (32, 8, 1)
    single = _round(5.0, 2.0)
    assert combine_rounds([single]) is single
    rounds = [_round(10.0, 1.5), _round(30.0, 1.1), _round(20.0, 1.9)]
    point = combine_rounds(rounds)
    assert point["loraplex"]["throughput_tok_s"] == 20.0  # the median round's own numbers
    assert point["throughput_ratio_vs_peft"] == 1.5  # the median of the rounds' paired ratios
    assert [r["loraplex_tok_s"] for r in point["rounds"]] == [10.0, 30.0, 20.0]
    assert combine_rounds(rounds[:2])["loraplex"]["throughput_tok_s"] == 10.0  # even: the lower median
    # Paired by round: the slow round's 1-adapter run is compared with the slow round's 32-adapter run.
    scaling = scaling_vs_fewest({1: [_round(100.0), _round(50.0)], 32: [_round(90.0), _round(46.0)]})
    assert scaling == {"32": pytest.approx((0.9 + 0.92) / 2)}
    assert scaling_vs_fewest({8: rounds}) is None


def test_repeats_are_validated():
    from server.bench.runner import BenchConfig, BenchConfigError

    with pytest.raises(BenchConfigError, match="--repeats"):
        BenchConfig(repeats=0)
    with pytest.raises(BenchConfigError, match="--repeats"):
        BenchConfig(workload_type="prefix", target="engine", repeats=2)
