"""LORAPLEX_STEP_TRACE on a real engine: one line per step, its rows as scheduled, and the same tokens as
an untraced engine."""
from __future__ import annotations

import json

from server.engine import LLM, SamplingParams
from server.engine.step_trace import TRACE_ENV
from tests.engine_helpers import drive


def _tokens(llm: LLM) -> list[int]:
    engine = llm.engine
    engine.add_request("long", list(range(3, 43)), SamplingParams(max_tokens=3, temperature=0.0), tenant="a")
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), tenant="b")
    final = drive(engine)
    return final["long"].token_ids + final["short"].token_ids


def test_each_step_is_one_line_with_its_rows(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    plain = _tokens(LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=16, max_model_len=128))
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    llm = LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=16, max_model_len=128)
    assert _tokens(llm) == plain
    llm.engine.shutdown()
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    chunks = [(r["tenant"], r["start"], r["tokens"]) for s in steps for r in s["rows"] if r["prompt"]]
    assert all(n <= 16 for _, _, n in chunks) and [start for _, start, _ in chunks[:2]] == [0, 0]  # both start
    assert sum(n for t, _, n in chunks if t == "a") == 40 and sum(n for t, _, n in chunks if t == "b") == 3
    decoded = [r["tenant"] for s in steps for r in s["rows"] if not r["prompt"]]
    assert sorted(decoded) == ["a", "a", "b", "b"]  # 3 tokens each: the first from the prompt's step
    assert all(s["run_s"] > 0 and s["start"] > 0 for s in steps)
    assert [s["start"] for s in steps] == sorted(s["start"] for s in steps)
