"""bench_body_cpu runs bench_abuse's attack bodies through the front end's parse and validation and
reports what the routes would answer (the numbers it prints are timings, not asserted)."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks.security import bench_body_cpu

pytestmark = pytest.mark.unit


def test_each_body_gets_the_routes_outcome(tmp_path, monkeypatch):
    out = tmp_path / "body.json"
    monkeypatch.setattr(sys, "argv", ["bench_body_cpu", "--repeat", "1", "--json", str(out)])
    bench_body_cpu.main()
    bodies = json.loads(out.read_text())["bodies"]
    assert bodies["huge_token_body"]["outcome"] == "400 too_many_values"
    assert {bodies[name]["outcome"] for name in ("logprob_echo_200mb", "tokenize_flood", "detokenize_flood")} == {"valid"}
