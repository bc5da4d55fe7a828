"""benchmarks/serving/fleet.py: its adapters are distinct and rank-matched to the small pool, its trace is
Zipf-skewed, and a --quick run writes every field the docs read (throughput ratio, hit rates, swaps,
TTFT and ITL percentiles, adapters per GiB) for both device layouts."""
from __future__ import annotations

import json
from collections import Counter

from adapters.format import ModelShape
from benchmarks.serving import fleet
from benchmarks.serving.fleet_adapters import RANKS, FleetSource, draw_fleet, same_rank_pool
from server.bench.workload import adapter_name


def test_small_pool_matches_each_fleet_adapters_rank():
    adapters = draw_fleet(200, seed=0)
    assert set(a.rank for a in adapters.values()) == set(RANKS)
    pool, to_pool = same_rank_pool(adapters, 8)
    assert len(pool) == 8 and not set(pool) & set(adapters)
    assert all(pool[to_pool[i]].rank == a.rank for i, a in adapters.items())


def test_zipf_trace_favours_the_first_adapters():
    cfg = fleet.FleetConfig(adapters=100, requests=2000)
    counts = Counter(r.adapter for r in fleet.zipf_trace(cfg, vocab=512))
    assert counts.most_common(1)[0][0] == 0
    # Zipf(1.0) over 100: adapter 0 has 1 / H(100) ~ 19% of requests, adapter 9 a tenth of that
    assert 0.15 < counts[0] / 2000 < 0.24 and counts[9] < counts[0] / 4


def test_copies_of_one_weight_set_are_distinct_adapters(demo_paths):
    shape = ModelShape.from_hf_config(json.loads((demo_paths.model_dir / "config.json").read_text()))
    specs = {adapter_name(i): a for i, a in draw_fleet(6, seed=0, ranks=(8,), bases=2).items()}
    source = FleetSource(demo_paths.model_dir, shape, 128, specs, bases=2, seed=0)
    a0, a2 = source(adapter_name(0)), source(adapter_name(2))  # the same base, different factors
    key = next(iter(a0.weights))
    assert a0.weights[key].a.equal(a2.weights[key].a)
    assert a0.weights[key].scaling != a2.weights[key].scaling


def test_quick_run_writes_the_reported_fields(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert fleet.main(["--quick", "--json", str(out), "--work-dir", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    assert {r["mode"] for r in doc["rows"]} == {"slots", "paged"}
    assert {r["adapters"] for r in doc["rows"]} == {40, 8}
    for row in doc["rows"]:
        assert row["window"]["throughput_tok_s"] is not None
        for key in ("ttft_s", "itl_s"):
            assert set(row["window"][key]) >= {"p50", "p99"}
        for key in ("device_hit_rate", "host_hit_rate", "swaps_per_s", "resident_per_gib", "ttft_by_residency"):
            assert key in row
        assert row["adapter_memory_bytes"] > 0
        if row["adapters"] == 40:
            assert "ratio_vs_small" in row
    assert doc["machine"]["load_average_start"] and doc["machine"]["cpu"]
    assert "TTFT by the adapter's place" in capsys.readouterr().out


def test_unified_memory_switch_runs_the_pages_in_one_pool():
    cfg, _ = fleet.parse_args(["--quick", "--unified-memory"])
    assert cfg.unified_memory and fleet.modes(cfg) == ("slots", "unified")
    assert fleet.modes(fleet.parse_args(["--quick"])[0]) == ("slots", "paged")
