"""The bench's engine variants: --quantization and --kv-cache-dtype passed through, several compared in one run."""
from __future__ import annotations

import json

import pytest

from server.bench.runner import BenchConfig, BenchConfigError
from server.bench.variants import EngineVariant, median_ratios, throughput_ratios, variant_order

pytestmark = pytest.mark.unit


def test_every_combination_in_the_given_order_the_first_the_reference():
    cfg = BenchConfig(quantization=("none", "int8"), kv_cache_dtype=("auto", "fp8_e4m3"))
    assert [v.label for v in cfg.variants] == ["weights=none,kv=auto", "weights=none,kv=fp8_e4m3",
                                               "weights=int8,kv=auto", "weights=int8,kv=fp8_e4m3"]
    assert variant_order(cfg.variants, 1)[0].label == "weights=int8,kv=fp8_e4m3"  # odd rounds: reversed


@pytest.mark.parametrize("kw, needle", [
    (dict(quantization=("nf4",)), "supported: int8, int4, fp8 or none"),
    (dict(kv_cache_dtype=("int8",)), "int8 KV is not implemented"),
    (dict(quantization=("int8", "int8")), "repeated values"),
    (dict(kv_cache_dtype=()), "at least one value"),
    (dict(quantization=("none", "int8"), compare_peft=True), "without --compare-peft"),
    (dict(kv_cache_dtype=("auto", "fp8"), workload_type="prefix", target="engine"), "mixed workload"),
])
def test_bad_variants_are_refused_with_a_reason(kw, needle):
    with pytest.raises(BenchConfigError, match=needle):
        BenchConfig(**kw)


def test_flags_reach_the_server_and_the_engine_only_when_not_the_default(tmp_path, tiny_model_dir):
    from server.bench.model_setup import engine_kwargs, serve_args

    plain = BenchConfig()
    assert "--quantization" not in serve_args(plain, 2) and "--kv-cache-dtype" not in serve_args(plain, 2)
    one = BenchConfig(quantization=("int8",), kv_cache_dtype=("fp8_e5m2",))
    args = serve_args(one, 2)
    assert args[args.index("--quantization") + 1] == "int8" and args[args.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
    kw = engine_kwargs(one, tiny_model_dir, 2)
    assert kw["quantization"] == "int8" and kw["kv_cache_dtype"] == "fp8_e5m2"
    other = EngineVariant("none", "fp8_e4m3")
    assert serve_args(one, 2, variant=other)[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]
    assert "quantization" not in engine_kwargs(one, tiny_model_dir, 2, variant=other)


def test_ratios_pair_variants_with_the_reference_and_take_medians_over_rounds():
    runs = {"a": {"throughput_tok_s": 10.0}, "b": {"throughput_tok_s": 15.0}, "c": {"throughput_tok_s": 5.0}}
    assert throughput_ratios(runs, "a") == {"b": 1.5, "c": 0.5}
    assert median_ratios([{"b": 1.5}, {"b": 1.1}, {"b": None}, {"b": 1.3}]) == {"b": 1.3}


def test_one_run_reports_the_variants_side_by_side(tiny_model_dir, tmp_path, capsys):
    from server.bench.cli import main

    out = tmp_path / "variants.json"
    rc = main(["--target", "engine", "--adapters", "2", "--requests", "4", "--prompt-len", "4:12",
               "--output-len", "3:6", "--tenants", "2", "--rank", "4", "--repeats", "2",
               "--quantization", "none,int8", "--kv-cache-dtype", "auto,fp8_e5m2",
               "--model", str(tiny_model_dir), "--json", str(out), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["quantization"] == ["none", "int8"]
    (point,) = doc["points"]
    labels = [v["label"] for v in point["variants"]]
    assert labels == ["weights=none,kv=auto", "weights=none,kv=fp8_e5m2", "weights=int8,kv=auto",
                      "weights=int8,kv=fp8_e5m2"]
    assert all(v["loraplex"]["completed"] == 4 for v in point["variants"])
    assert set(point["variant_throughput_ratios"]) == set(labels[1:])
    assert all(r > 0 for r in point["variant_throughput_ratios"].values())
    assert all(set(r["variant_throughput_ratios"]) == set(labels[1:]) for r in point["rounds"])
    printed = capsys.readouterr().out
    assert "weights=int8,kv=fp8_e5m2: out tok/s x" in printed and "the reference" in printed
