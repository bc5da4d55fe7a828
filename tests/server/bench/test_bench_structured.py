"""The structured workload's set-up (server.bench.structured); the run itself is a benchmark
(python -m benchmarks.serving.bench --workload structured), not a test."""
from __future__ import annotations

import jsonschema
import pytest

from server.bench.cli import add_bench_arguments, config_from_args
from server.bench.runner import BenchConfigError
from server.bench.schema_suite import load_suite
from server.bench.structured import _long_array, _validity_summary, Outcome, format_structured_table

pytestmark = pytest.mark.unit


def _cfg(*argv):
    import argparse

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return config_from_args(p.parse_args(["--workload", "structured", *argv]))


def test_structured_defaults_are_the_issues_targets():
    cfg = _cfg()
    assert cfg.concurrency == (32,) and cfg.num_requests == len(load_suite()) and cfg.base_share == 0.25
    assert _cfg("--base-share", "0").base_share == 0.0  # an explicit 0 is honoured


@pytest.mark.parametrize("argv", [("--target", "engine"), ("--compare-peft",), ("--rate", "5")])
def test_structured_refuses_what_it_cannot_honour(argv):
    with pytest.raises(BenchConfigError):
        _cfg(*argv)


def test_long_array_cannot_close_early_and_keeps_refs():
    _, schema = next((n, s) for n, s in load_suite() if "$defs" in s)
    wrapped = _long_array(schema, 3)
    validator = jsonschema.Draft202012Validator(wrapped)
    assert not validator.is_valid([])  # minItems holds
    assert wrapped["$defs"] == schema["$defs"] and "$defs" not in wrapped["items"]


def test_validity_counts_only_completed_outputs():
    outcomes = [Outcome("a", "m", "stop", True, json_valid=True),
                Outcome("b", "m", "stop", False, "bad", json_valid=True),
                Outcome("e", "m", "stop", False, "Expecting value", json_valid=False),
                Outcome("c", "base", "length", tail="1111"), Outcome("d", "base", None, None, "HTTP 400")]
    v = _validity_summary(outcomes)
    assert (v["stop"], v["valid_json"], v["valid"], v["length"], v["errors"], v["met"]) == (3, 2, 1, 1, 1, False)
    assert v["valid_share_of_stop"] == 1 / 3 and [o["schema"] for o in v["invalid"]] == ["b", "e"]
    doc = {"validity": v, "targets": {"throughput_loss": 0.1},
           "throughput": {"concurrency": 2, "max_tokens": 4, "rounds": {"unconstrained": [{"tok_s": 10.0}],
                                                                         "half_constrained": [{"tok_s": 9.5}]},
                          "median_tok_s": {"unconstrained": 10.0, "half_constrained": 9.5},
                          "median_tok_per_server_cpu_s": {"unconstrained": 5.0, "half_constrained": 4.0},
                          "ratio_half_constrained": 0.95, "loss": 0.05, "ratio_half_constrained_cpu": 0.8,
                          "loss_cpu": 0.2, "met": False}}
    table = format_structured_table(doc)
    assert "33.3%" in table and "loss 5.0%" in table and "loss 20.0%" in table and "missed" in table
