"""The per-step diagnostic trace (server.engine.step_trace): each row as scheduled, one JSON line a step."""
from __future__ import annotations

import json

import pytest

from server.engine.scheduler import ScheduledBatch
from server.engine.step_trace import TRACE_ENV, RowRecord, StepRecord, StepTrace, rows_of
from tests.server.engine.sequences import request

pytestmark = pytest.mark.unit


def test_rows_tell_decoding_rows_from_prompt_chunks_with_their_logprob_rows():
    decoding = request([1, 2, 3], 0, tenant="victim")
    decoding.num_computed_tokens = 3
    decoding.token_ids.append(7)  # its first output token, not in the KV cache yet
    chunk = request(list(range(10)), 1, tenant="attacker", prompt_logprobs=2)
    chunk.group.prompt_logprobs = [None]  # the first position's entry (it has none) is out
    chunk.num_computed_tokens = 4
    batch = ScheduledBatch(seqs=[decoding, chunk], num_tokens=[1, 3], lora_slots=[-1, -1], drafts=[(), ()])
    assert rows_of(batch) == (RowRecord("victim", 3, 1, False, 0), RowRecord("attacker", 4, 3, True, 3))


def test_off_without_the_variable_and_one_json_line_a_step_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert StepTrace.from_env() is None
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "steps.jsonl"))
    trace = StepTrace.from_env()
    trace.write(StepRecord(1.5, 0.001, 0.002, 0.0005, 16.0, (RowRecord("a", 0, 4, True, 0),)))
    trace.write(StepRecord(1.6, 0.001, 0.002, 0.0005, None, ()))
    trace.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert lines[0]["rows"] == [{"tenant": "a", "start": 0, "tokens": 4, "prompt": True, "logprob_rows": 0}]
    assert lines[0]["prompt_budget"] == 16.0 and lines[1]["prompt_budget"] is None
    assert [line["start"] for line in lines] == [1.5, 1.6]
