"""The victim benches' --trace report (benchmarks/security/step_trace_report.py): a gap is lined up with the
engine steps that ran during it, and what no step covered is counted as time outside the engine."""
from __future__ import annotations

import json

import pytest

from benchmarks.security.step_trace_report import report
from server.engine.step_trace import RowRecord, StepRecord, StepTrace

pytestmark = pytest.mark.unit


def test_a_gap_reads_as_its_steps_and_the_time_outside_them(tmp_path):
    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    decode = RowRecord("v1", 10, 1, False, 0)  # the tenant with the most decoding rows: the victim
    chunk = RowRecord("a1", 1800, 3, True, 3)
    trace.write(StepRecord(100.000, 0.0001, 0.0018, 0.0001, 16.0, (decode, chunk)))  # 2 ms
    trace.write(StepRecord(100.010, 0.0001, 0.0008, 0.0001, None, (decode,)))  # 1 ms
    trace.write(StepRecord(200.000, 0.0001, 0.0008, 0.0001, None, (decode,)))  # after the phase
    trace.close()
    (tmp_path / "p-victim.json").write_text(json.dumps({
        "start": 99.0, "end": 101.0, "gaps": [[100.002, 0.003], [100.021, 0.011]], "requests": [[99.5, 99.6]]}))
    text = report(tmp_path, "p", top=2)
    lines = text.splitlines()
    assert lines[0] == "p: 2 steps, 2 victim gaps, 1 victim requests"
    assert any(line.strip().startswith("victim decodes + other's chunk, capped") for line in lines)
    assert "victim time to first token: p50 100.00 ms" in text
    longest, second = [line for line in lines if " ms gap, " in line]
    assert longest.strip().startswith("11.00 ms gap, 10.00 ms outside steps: 0.00 +1.00")  # the engine idled
    assert second.strip().startswith("3.00 ms gap, 1.00 ms outside steps: 1.00 +2.00") and "(1800, 3, 3)" in second
