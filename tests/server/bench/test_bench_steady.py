"""The publishable bench (issue 21): one trace for base and adapter runs, the steady-state window,
the bandwidth bounds, rounds with spread, slots and churn, and short real runs on the tiny model."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from server.bench.metrics import RequestRecord, window_summary
from server.bench.workload import WorkloadConfig, check_same_trace, generate_workload, trace_totals


def _trace(**kw):
    base = dict(num_adapters=8, num_requests=300, prompt_len=(4, 40), output_len=(2, 30), num_tenants=3, seed=7)
    return generate_workload(WorkloadConfig(**{**base, **kw}))


def test_base_and_adapter_traces_have_equal_token_totals():
    base = _trace(num_adapters=0)
    assert all(r.adapter is None for r in base)
    totals = [trace_totals(t) for t in (base, _trace(), _trace(num_adapters=64, alpha=0.3), _trace(base_share=0.5))]
    check_same_trace(totals)
    assert totals[0]["prompt_tokens"] == sum(len(r.prompt_ids) for r in base) > 300 * 4
    assert totals[0]["output_tokens"] == sum(r.max_tokens for r in base)
    with pytest.raises(AssertionError, match="same trace"):
        check_same_trace([totals[0], trace_totals(_trace(seed=8))])


def test_adapter_assignment_has_its_own_rng():
    """Changing the adapter count, popularity or base share moves no prompt, length or arrival
    (the first H100 run's base point drew a different workload: 10,497 against 10,241 tokens)."""
    ref = _trace(rate=50.0)
    for kw in (dict(num_adapters=0), dict(num_adapters=1), dict(num_adapters=64), dict(alpha=0.2),
               dict(base_share=0.3), dict(round_robin=True)):
        other = _trace(rate=50.0, **kw)
        assert [(r.prompt_ids, r.max_tokens, r.arrival_s) for r in other] == \
               [(r.prompt_ids, r.max_tokens, r.arrival_s) for r in ref]
    assert [r.adapter for r in _trace(num_adapters=64)] != [r.adapter for r in ref]  # the assignment does move
    assert [r.adapter for r in _trace(seed=7)] == [r.adapter for r in ref]            # and is seeded
    assert [r.adapter for r in _trace(round_robin=True)] == [i % 8 for i in range(300)]  # "distinct"


def _rec(arrival, times, counts=None, end=None):
    r = RequestRecord(0, "t", None, arrival, 4, len(times))
    r.token_times_s, r.token_counts = list(times), list(counts or [])
    r.first_token_s = times[0] if times else None
    r.end_s = end
    return r


def test_window_counts_only_what_happened_inside_it():
    records = [
        _rec(0.0, [0.5, 1.5, 2.5, 3.5], end=3.5),      # sent in warm-up: its tokens at 1.5 and 2.5 count
        _rec(1.2, [1.4, 2.0, 2.2], [1, 2, 3], end=2.2),  # sent in the window, 6 tokens, finished in it
        _rec(2.9, [3.2, 3.4]),                         # sent in the window, tokens after it
        _rec(3.1, [3.3], end=3.3),                     # sent after the window: nothing counts
    ]
    w = window_summary(records, 1.0, 3.0)
    assert w["window_s"] == 2.0
    assert w["output_tokens"] == 2 + 6 and w["throughput_tok_s"] == 4.0
    assert w["requests_sent"] == 2 and w["requests_finished"] == 1
    assert w["ttft_s"]["p50"] == pytest.approx((0.2 + 0.3) / 2)      # 1.4 - 1.2 and 3.2 - 2.9
    # gaps ending inside: 1.0 (0.5->1.5), 1.0 (1.5->2.5), 0.6 (1.4->2.0), 0.2 (2.0->2.2)
    assert w["itl_s"]["p50"] == pytest.approx(0.8) and w["itl_s"]["p99"] == pytest.approx(1.0)
    empty = window_summary(records, 3.0, 3.0)
    assert empty["throughput_tok_s"] is None and empty["output_tokens"] == 0


def test_step_kinds_count_the_steps_that_ended_in_the_window():
    from server.bench.step_kinds import StepSample, step_kinds

    samples = [StepSample(0.9, 0.02, False),   # warm-up
               StepSample(1.0, 0.025, False), StepSample(1.01, 0.01, True), StepSample(1.02, 0.01, True),
               StepSample(3.0, 0.03, True)]    # after the window
    kinds = step_kinds(samples, 1.0, 3.0)
    assert (kinds["steps"], kinds["graphed"], kinds["eager"]) == (3, 2, 1)
    assert kinds["graphed_s"] == pytest.approx(0.02) and kinds["eager_s"] == pytest.approx(0.025)
    assert kinds["graphed_ms_mean"] == pytest.approx(10.0) and kinds["eager_ms_mean"] == pytest.approx(25.0)
    assert step_kinds([], 1.0, 3.0)["eager_ms_mean"] is None


def test_bound_for_64_rank16_adapters_on_llama3_8b():
    from server.bench import bandwidth
    from server.bench.gpu_model import LLAMA3_8B

    one = bandwidth.adapter_bytes(LLAMA3_8B, 16, 2)
    # per layer r * (in + out): q 8192, k 5120, v 5120, o 8192, gate/up/down 18432 each = 81920
    assert one == 32 * 16 * 81920 * 2 == 83_886_080  # 83.9 MB, issue 21
    base = bandwidth.base_weight_bytes(LLAMA3_8B, 2)
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert base == (32 * layer + 4096 + 128256 * 4096) * 2
    b = bandwidth.bound(base, 64 * one, base_step_s=0.009, bandwidth_gbps=3350.0)
    assert b["extra_s"] == pytest.approx(64 * 83_886_080 / 3.35e12)           # 1.60 ms
    assert b["bound"] == b["time_bound"] == pytest.approx(0.009 / (0.009 + 0.0016026), rel=1e-4)  # 0.849
    assert b["bytes_bound"] == pytest.approx(base / (base + 64 * one))
    assert bandwidth.bound(base, 0)["bound"] == 1.0
    assert bandwidth.device_bandwidth_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert bandwidth.device_bandwidth_gbps("NVIDIA H200") == 4800.0 and bandwidth.device_bandwidth_gbps("cpu") is None
    assert bandwidth.weight_read_floor_s(base, 3350.0) == pytest.approx(base / 3.35e12)
    # uniform: n (1 - (1 - 1/n)^C); a skewed law concentrates on fewer adapters
    assert bandwidth.expected_distinct(64, 64) == pytest.approx(64 * (1 - (63 / 64) ** 64))
    assert bandwidth.expected_distinct(64, 64, 0.3) < bandwidth.expected_distinct(64, 64)
    assert bandwidth.expected_distinct(8, 1) == pytest.approx(1.0) and bandwidth.expected_distinct(0, 64) == 0.0


def test_rounds_give_the_median_and_the_spread():
    from server.bench.rounds import combine_rounds, spread

    rounds = [{"num_adapters": 8, "loraplex": {"throughput_tok_s": v}} for v in (90.0, 110.0, 100.0)]
    point = combine_rounds(rounds)
    assert point["loraplex"]["throughput_tok_s"] == 100.0
    assert point["loraplex_tok_s_spread"] == {"median": 100.0, "min": 90.0, "max": 110.0, "rel_range": 0.2, "n": 3}
    assert spread([2.0]) == {"median": 2.0, "min": 2.0, "max": 2.0, "rel_range": 0.0, "n": 1}
    empty = [{"num_adapters": 8, "loraplex": {"throughput_tok_s": None}}, rounds[0]]
    assert combine_rounds(empty)["loraplex"]["throughput_tok_s"] is None  # an empty window ranks lowest


def test_slots_cover_the_adapters_and_churn_is_its_own_case():
    from server.bench.model_setup import SlotError, lora_slots
    from server.bench.runner import BenchConfig, BenchConfigError
    from server.bench.steady import plan_cases

    assert lora_slots(None, 64) == 64 and lora_slots(None, 0) == 1 and lora_slots(80, 64) == 80
    with pytest.raises(SlotError, match="churn"):
        lora_slots(32, 63)
    assert lora_slots(32, 64, churn=True) == 32
    cfg = BenchConfig(workload_type="steady", target="engine", num_requests=100, adapter_counts=(0, 1, 8),
                      ranks=(16, 8), popularity=("uniform", "power"), churn=(16, 4))
    assert [c.name for c in plan_cases(cfg)] == [
        "base", "r16-1-uniform", "r16-1-power", "r16-8-uniform", "r16-8-power", "r8-1-uniform", "r8-1-power",
        "r8-8-uniform", "r8-8-power", "churn-r16-16-over-4"]
    distinct = plan_cases(replace(cfg, popularity=("distinct",), churn=None))[1]
    assert distinct.name == "r16-1-distinct" and distinct.popularity == "distinct" and distinct.alpha == 1.0
    churn = plan_cases(cfg)[-1]
    assert churn.churn and churn.slots == 4 and churn.num_adapters == 16
    for kw, flag in ((dict(churn=(4, 4)), "--churn"), (dict(concurrency=(0,)), "--concurrency"),
                     (dict(popularity=("zipf",)), "--popularity"), (dict(rate=5.0), "--rate"),
                     (dict(compare_peft=True), "--peft-check")):
        with pytest.raises(BenchConfigError, match=flag):
            BenchConfig(**{**dict(workload_type="steady", target="engine"), **kw})
    with pytest.raises(BenchConfigError, match="steady"):
        BenchConfig(ranks=(16, 8))
    for kw, flag in ((dict(concurrency=(8,)), "--concurrency"), (dict(device_bandwidth_gbps=3350.0), "--device"),
                     (dict(steady_s=5.0), "--steady-duration")):
        with pytest.raises(BenchConfigError, match=flag):
            BenchConfig(**kw)  # the mixed workload would ignore them


def _steady(tiny_model_dir, tmp_path, **kw):
    from server.bench.runner import BenchConfig

    base = dict(workload_type="steady", target="engine", model_dir=str(tiny_model_dir), adapter_counts=(2,),
                ranks=(4,), num_requests=4000, prompt_len=(4, 12), output_len=(4, 8), concurrency=(3,),
                warmup_s=0.3, steady_s=1.0, cpu_threads=1, work_dir=str(tmp_path / "work"),
                max_num_batched_tokens=512)
    return BenchConfig(**{**base, **kw})


def _check_row(row, rounds: int) -> None:
    w = row["loraplex"]
    assert w["window_s"] == pytest.approx(1.0) and not row["window_short"] and not row["trace_exhausted"]
    assert w["output_tokens"] > 0 and w["throughput_tok_s"] == pytest.approx(w["output_tokens"] / 1.0)
    assert w["ttft_s"]["p50"] > 0 and w["itl_s"]["p99"] >= w["itl_s"]["p50"] > 0
    assert row["short_outputs"] == 0 and row["errors"] == []
    assert row["loraplex_tok_s_spread"]["n"] == rounds
    assert row["machine"]["gpu_clocks"] is None and len(row["machine"]["load_avg"]) == 3  # CPU: no clocks
    steps = row["steps"]
    if row["target"] == "http":
        assert steps is None  # the client cannot see the engine's steps
        return
    # The window's engine steps, by kind: on a CPU none replays a CUDA graph.
    assert steps["steps"] > 0 and steps["graphed"] + steps["eager"] == steps["steps"]
    assert steps["graphed"] == 0 and steps["graphed_s"] == 0.0 and steps["graphed_ms_mean"] is None
    assert 0 < steps["eager_s"] <= w["window_s"]
    assert steps["eager_ms_mean"] == pytest.approx(1e3 * steps["eager_s"] / steps["eager"])


def test_steady_engine_rounds_bounds_and_token_ids(tiny_model_dir, tmp_path):
    """Two rounds of base and one adapter case in the engine, a peft check on token ids; a short
    trace ends its steady state early, which the row says."""
    from server.bench.report import format_table
    from server.bench.runner import run_bench

    out = tmp_path / "steady.json"
    doc = run_bench(_steady(tiny_model_dir, tmp_path, repeats=2, peft_check=4), out, log=lambda m: None)
    assert [r["case"] for r in json.loads(out.read_text())["rows"]] == ["base", "r4-2-uniform"]
    rows = {r["case"]: r for r in doc["rows"]}
    for row in rows.values():
        _check_row(row, 2)
    adapter = rows["r4-2-uniform"]
    assert adapter["ratio_vs_base"]["n"] == 2 and adapter["slots"] == 2 and adapter["target"] == "engine"
    b = adapter["bounds"]
    assert 0 < b["bound"] < 1 and b["bandwidth_gbps"] is None and 1 <= b["distinct_per_step"] <= 2
    assert doc["token_ids_vs_peft"]["r4-2-uniform"] == {"compared": 4, "same": 4, "mismatches": []}
    assert doc["trace"]["requests"] == 4000
    table = format_table(doc)
    assert "token ids = peft (r4-2-uniform): 4/4" in table and "bound:" in table
    assert f" 0/{rows['base']['steps']['steps']} 0%" in table  # the graphed column

    short = run_bench(_steady(tiny_model_dir, tmp_path, num_requests=30, adapter_counts=(0,), steady_s=30.0),
                      None, log=lambda m: None)
    (row,) = short["rows"]
    assert row["trace_exhausted"] and row["window_short"] and row["loraplex"]["window_s"] < 30.0
    assert row["requests_sent"] == 30 and "SHORT WINDOW" in format_table(short)


def test_steady_http_runs_beside_the_engine(tiny_model_dir, tmp_path):
    from server.bench.runner import run_bench

    # The base case alone: one server start (the adapter path over HTTP is test_bench.py's CLI run).
    doc = run_bench(_steady(tiny_model_dir, tmp_path, target="http", adapter_counts=(0,)), None, log=lambda m: None)
    assert [(r["case"], r["target"]) for r in doc["rows"]] == [("base", "engine"), ("base", "http")]
    for row in doc["rows"]:
        _check_row(row, 1)


def test_mixed_sweep_serves_one_trace_and_checks_token_ids(tiny_model_dir, tmp_path):
    """The burst sweep: base and adapter points get the same requests, so the same token totals
    (ignore_eos), and the engine target's token ids are compared with peft's request by request."""
    from server.bench.runner import BenchConfig, run_bench

    cfg = BenchConfig(target="engine", model_dir=str(tiny_model_dir), adapter_counts=(0, 3), ranks=(4,),
                      num_requests=10, prompt_len=(4, 12), output_len=(3, 9), compare_peft=True, cpu_threads=1,
                      work_dir=str(tmp_path / "work"))
    doc = run_bench(cfg, None, log=lambda m: None)
    base, adapters = doc["points"]
    assert base["trace"] == adapters["trace"] and base["adapters_in_use"] == 0 and adapters["adapters_in_use"] > 1
    for p in (base, adapters):
        assert p["loraplex"]["output_tokens"] == p["baseline"]["output_tokens"] == p["trace"]["output_tokens"]
        assert p["loraplex"]["prompt_tokens"] == p["trace"]["prompt_tokens"]
        assert p["token_ids_vs_peft"] == {"compared": 10, "same": 10, "mismatches": []}


def test_token_id_mismatches_are_reported_per_request():
    from server.bench.token_check import compare_token_ids

    reqs = _trace(num_requests=3)
    check = compare_token_ids(reqs, {0: [1, 2, 3], 1: [4, 5], 2: [7]}, {0: [1, 2, 3], 1: [4, 6]})
    assert check["compared"] == 3 and check["same"] == 1
    assert [(m["index"], m["first_mismatch"], m["peft_tokens"]) for m in check["mismatches"]] == [(1, 1, 2),
                                                                                                 (2, None, None)]


def test_rows_carry_the_bound_from_the_measured_base_step_and_the_batch1_floor():
    from server.bench import bandwidth
    from server.bench.gpu_model import LLAMA3_8B
    from server.bench.runner import BenchConfig
    from server.bench.steady import combine

    def run(case, n, c, tok_s, rank=16):
        return {"case": case, "num_adapters": n, "rank": rank if n else None, "alpha": 1.0, "slots": max(n, 1),
                "concurrency": c, "target": "engine", "loraplex": {"throughput_tok_s": tok_s}}

    rounds = {("base", 64, "engine"): [run("base", 0, 64, 6400.0), run("base", 0, 64, 6000.0)],
              ("r16-64-uniform", 64, "engine"): [run("r16-64-uniform", 64, 64, 4800.0),
                                                 run("r16-64-uniform", 64, 64, 4800.0)],
              ("base", 1, "engine"): [run("base", 0, 1, 150.0)]}
    rows = {(r["case"], r["concurrency"]): r for r in combine(BenchConfig(dtype="bfloat16"), rounds, LLAMA3_8B, 3350.0)}
    adapter = rows[("r16-64-uniform", 64)]
    assert adapter["ratio_vs_base"]["median"] == pytest.approx((0.75 + 0.8) / 2)  # paired by round
    b = adapter["bounds"]
    step = 64 / 6000.0  # the median base round (the lower of two): 6000 tok/s, one token per sequence per step
    extra = bandwidth.expected_distinct(64, 64) * 83_886_080
    assert b["extra_bytes"] == pytest.approx(extra) and b["distinct_per_step"] == pytest.approx(40.64, abs=0.01)
    assert b["time_bound"] == pytest.approx(step / (step + extra / 3.35e12))
    assert b["share_of_bound"] == pytest.approx(0.775 / b["time_bound"])
    floor = rows[("base", 1)]["bounds"]
    assert floor["weight_read_floor_ms"] == pytest.approx(1e3 * bandwidth.base_weight_bytes(LLAMA3_8B, 2) / 3.35e12)
    assert floor["base_step_over_floor"] == pytest.approx((1 / 150.0) / (floor["weight_read_floor_ms"] / 1e3))
