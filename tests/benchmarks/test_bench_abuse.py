"""The abuse benchmark's harness (benchmarks/security/bench_abuse.py) runs end to end against a real server for a
few seconds: the victim keeps streaming and /health keeps answering through each attack, and every
attack gets the refusal it should. Bounds are generous: speed is the benchmark's business."""
from __future__ import annotations

import os

import pytest

from benchmarks.profile.server_profile import ENGINE_THREAD, can_profile
from benchmarks.security import abuse
from benchmarks.security.victim_harness import Target, profile_text


def test_abuse_harness_runs_and_the_victim_keeps_streaming(api_server):
    engine = api_server.state.engine.engine
    target = Target(api_server.url, api_server.config.admin_token, api_server.state.model_id,
                    engine.max_model_len, api_server.config.max_logprob_entries)
    only = ["huge_token_body", "huge_body_over_quota", "detokenize_2e20_ids", "logprob_echo_200mb", "n_x_max_tokens"]
    report = abuse.run(target, phase_s=2.0, only=only)
    assert list(report["phases"]) == ["baseline", *only]
    for name, phase in report["phases"].items():
        assert phase["victim_errors"] == 0, (name, phase)
        assert phase["victim_gaps"] > 0 and phase["health_probes"] > 0, (name, phase)
        assert phase["health_max_ms"] < 10_000, (name, phase)  # never a stall like the 5 s seen before
        if name != "baseline":
            assert "itl_p99_vs_baseline" in phase and isinstance(phase["met"], bool)
    statuses = {name: set(p["attack_statuses"]) for name, p in report["phases"].items()}
    assert statuses["huge_token_body"] == {"400"}
    assert statuses["huge_body_over_quota"] <= {"400", "429"} and "429" in statuses["huge_body_over_quota"]
    assert statuses["detokenize_2e20_ids"] == {"400"}
    assert statuses["logprob_echo_200mb"] == {"400"}
    assert statuses["n_x_max_tokens"] == {"400"}
    assert "ITL p99 ms" in abuse.table(report)


@pytest.mark.skipif(can_profile() is not None, reason=f"cannot profile here: {can_profile()}")
def test_a_profiled_phase_says_where_the_server_cpu_went(api_server, tmp_path):
    # The server runs in this process: py-spy and the kernel's counters read it like a real one.
    engine = api_server.state.engine.engine
    target = Target(api_server.url, api_server.config.admin_token, api_server.state.model_id,
                    engine.max_model_len, api_server.config.max_logprob_entries)
    report = abuse.run(target, phase_s=2.0, only=["n_x_max_tokens"], profile=(os.getpid(), tmp_path))
    for name, phase in report["phases"].items():
        profile = phase["server_profile"]
        assert (tmp_path / f"{name}.txt").exists() and profile["samples"] > 0, (name, profile)
        kernel = profile["kernel"]
        threads = {t["name"]: t for t in kernel["threads"]}
        assert threads[ENGINE_THREAD]["cpu_cores"] > 0, kernel  # the victim streamed: the engine ran
        assert kernel["cpus"] == sorted(os.sched_getaffinity(0)) and kernel["others_on_those_cpus_cores"] >= 0
        assert phase["engine_cpu_ms_per_victim_token"] > 0 and phase["engine_core_wait_ms_per_victim_token"] >= 0
    text = profile_text(report)
    assert "kernel: server tree" in text and ENGINE_THREAD in text
