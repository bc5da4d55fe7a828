"""benchmarks/engine/bench_quant_memory.py: one variant's measurement and the weights-share arithmetic."""
from __future__ import annotations

from benchmarks.engine.bench_quant_memory import measure, with_shares


def test_measure_reports_rss_and_the_weights_bytes(tiny_model_dir):
    row = measure(str(tiny_model_dir), "int8", requests=2, max_tokens=4, device="cpu")
    assert row["variant"] == "int8" and row["projections"] == "int8" and row["tokens"] == 8
    assert row["rss_bytes"] > 0 and row["peak_rss_bytes"] >= row["rss_bytes"] and row["gpu_allocated_bytes"] is None
    assert sum(row["weights_bytes_by_dtype"].values()) == row["weights_bytes"]
    assert set(row["weights_bytes_by_dtype"]) == {"float32", "int8"}


def test_the_weights_share_is_rss_less_what_float32_holds_besides_its_weights():
    rows = with_shares([{"variant": "float32", "rss_bytes": 1000, "weights_bytes": 600},
                        {"variant": "int8", "rss_bytes": 600, "weights_bytes": 200}])
    assert rows[0]["share_vs_float32_weights"] == 1.0 and rows[0]["rss_vs_float32"] == 1.0
    assert rows[1]["weights_share_bytes"] == 200 and rows[1]["share_vs_float32_weights"] == round(200 / 600, 3)
