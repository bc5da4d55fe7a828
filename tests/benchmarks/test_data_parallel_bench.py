"""benchmarks/serving/data_parallel.py's pieces that need no server: the trace and the table (the run
itself is the bench's, recorded in docs/scaling.md)."""
from __future__ import annotations

import pytest

from benchmarks.serving.data_parallel import ADAPTERS, QUICK, SERVERS, format_table, summarize, zipf_trace

pytestmark = pytest.mark.unit


def test_the_trace_is_the_same_per_round_and_skewed_over_32_adapters():
    trace = zipf_trace(QUICK, 0)
    assert trace == zipf_trace(QUICK, 0) and trace != zipf_trace(QUICK, 1)
    assert len(trace) == QUICK.requests and all(len(p) == QUICK.prompt_len for _, p in trace)
    names = [name for name, _ in zipf_trace(QUICK, 0) + zipf_trace(QUICK, 1)]
    assert set(names) <= {f"a{k}" for k in range(ADAPTERS)}
    assert names.count("a0") > names.count("a31")


def test_the_report_pairs_rounds_and_the_table_has_a_row_per_server():
    rounds = [{name: {"tokens_per_s": (i + 1) * (2.0 if name == "dp2" else 1.0), "device_hit_rate": 0.5}
               for name in SERVERS} for i in range(3)]
    doc = summarize(rounds, QUICK, (3.0, 2.0, 1.0))
    assert doc["summary"]["dp2"]["over_one_core"] == 2.0 and doc["summary"]["dp2"]["tokens_per_s"] == 4.0
    assert doc["servers"]["dp2 rr"] == {"data_parallel_size": 2, "routing": "round-robin", "torch_threads": 1}
    table = format_table(doc)
    assert all(name in table for name in SERVERS) and "2.00x" in table and "shared machine" in table
