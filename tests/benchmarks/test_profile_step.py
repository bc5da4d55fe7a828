"""benchmarks/profile/profile_step.py splits a real decode and prefill step into phases, forward parts and ops."""
from __future__ import annotations

import json

import pytest

from benchmarks.profile import profile_step as step_profile

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def profile_step():
    return step_profile


def _run(profile_step, tmp_path, adapters: int) -> dict:
    out = tmp_path / f"profile-{adapters}.json"
    rc = profile_step.main(["--layers", "1", "--adapters", str(adapters), "--decode-seqs", "6", "--context", "20",
                            "--prefill-seqs", "2", "--prefill-len", "40", "--steps", "2", "--cpu-threads", "1",
                            "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_the_breakdown_covers_the_step(profile_step, tmp_path, capsys):
    doc = _run(profile_step, tmp_path, adapters=3)
    assert "## decode step (6 seqs at context 20)" in capsys.readouterr().out
    for kind in ("decode", "prefill"):
        r = doc[kind]
        assert set(r["phase_ms"]) == {"schedule", "prepare", "forward", "sample", "postprocess"}
        parts = r["part_ms"]
        assert all(v > 0 for k, v in parts.items() if k != "rest of forward"), parts  # every kernel was seen
        # The parts are measured inside the forward, so together they cannot exceed it (5% for timer skew).
        assert sum(v for k, v in parts.items() if k != "rest of forward") <= 1.05 * r["phase_ms"]["forward"]
        assert r["top_ops"] and all(o["op"] not in parts for o in r["top_ops"])


def test_no_adapters_means_no_lora_time(profile_step, tmp_path):
    doc = _run(profile_step, tmp_path, adapters=0)
    for kind in ("decode", "prefill"):
        parts = doc[kind]["part_ms"]
        assert parts["lora"] == 0
        assert parts["paged_attention"] > 0 and parts["lm_head"] > 0
