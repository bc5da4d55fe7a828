"""The abuse benchmark's harness (benchmarks/security/bench_abuse.py) runs end to end against a real server for a
few seconds: the victim keeps streaming and /health keeps answering through each attack, and every
attack gets the refusal it should. Bounds are generous: speed is the benchmark's business."""
from __future__ import annotations

import os
import shutil

import pytest

from benchmarks.profile.server_profile import ENGINE_THREAD, can_profile
from benchmarks.security import abuse
from benchmarks.security.victim_harness import Target, profile_text
from tests.fixtures_server import api_redis_url, running_server, server_config

FETCH_TIMEOUT_S = 2.0
COMPILE_DEADLINE_MS = 1000
COLD = ("r4_qv", "r8_all")  # distinct adapters: each load is a cold one


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, tiny_adapters):
    """The API server with local and loopback http adapter sources (slow_source's), short fetch and
    compile deadlines (so the phases stay short) and a 2 s rate window (huge_body_over_quota's)."""
    root = tmp_path_factory.mktemp("abuse-local-adapters")
    for name in COLD:
        shutil.copytree(tiny_adapters[name], root / name)
    config = server_config(
        tiny_model_dir, tmp_path_factory.mktemp("abuse-data"), api_redis_url(redis_server), rate_window_seconds=2.0,
        adapter_sources=("http", "local"), adapter_local_root=str(root), adapter_http_hosts=("127.0.0.1",),
        adapter_allow_private_networks=True, adapter_fetch_timeout=FETCH_TIMEOUT_S,
        max_grammar_compile_ms=COMPILE_DEADLINE_MS)
    with running_server(config) as handle:
        yield handle


def _target(server) -> Target:
    return Target(server.url, server.config.admin_token, server.state.model_id,
                  server.state.engine.info.max_model_len, server.config.max_logprob_entries,
                  FETCH_TIMEOUT_S, COMPILE_DEADLINE_MS / 1000)


def test_abuse_harness_runs_and_the_victim_keeps_streaming(server):
    target = _target(server)
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


def test_issue43_phases_report_the_attacker_outcome_and_the_victim_probes(server):
    target = _target(server)
    only = ["nested_grammar", "slow_source", "compile_flood"]
    report = abuse.run(target, phase_s=2.0, only=only, cold_adapters=list(COLD))
    assert list(report["phases"]) == ["baseline", *only]
    phases = report["phases"]
    for name, phase in phases.items():
        assert phase["victim_errors"] == 0 and phase["victim_gaps"] > 0, (name, phase)
        if name != "baseline":
            assert phase["attacker_longest_s"] > 0 and phase["attacker_budget_s"] > 0, (name, phase)
            assert isinstance(phase["attacker_within_budget"], bool) and isinstance(phase["met"], bool)
    assert phases["baseline"]["victim_probes"]["cold_local_load_statuses"] == [200]
    assert phases["baseline"]["victim_probes"]["new_schema_status"] == 200
    assert set(phases["nested_grammar"]["attack_statuses"]) == {"400"}
    # Every slow or dripping fetch ends at the fetch deadline (504), the cold local load meanwhile is served.
    assert set(phases["slow_source"]["attack_statuses"]) == {"504"}, phases["slow_source"]
    assert phases["slow_source"]["attacker_longest_s"] < FETCH_TIMEOUT_S + 5, phases["slow_source"]
    assert phases["slow_source"]["victim_probes"]["cold_local_load_statuses"] == [200]
    # Past the deadline: 400; past the flooder's 2 requests a window: 429.
    assert set(phases["compile_flood"]["attack_statuses"]) <= {"400", "429"}, phases["compile_flood"]
    assert "400" in phases["compile_flood"]["attack_statuses"], phases["compile_flood"]
    assert phases["compile_flood"]["victim_probes"]["new_schema_status"] == 200
    text = abuse.table(report)
    print(text)
    assert "attacker longest s (budget)" in text and "cold load" in text and "new schema" in text


@pytest.mark.skipif(can_profile() is not None, reason=f"cannot profile here: {can_profile()}")
def test_a_profiled_phase_says_where_the_server_cpu_went(server, tmp_path):
    # The server runs in this process: py-spy and the kernel's counters read it like a real one.
    target = _target(server)
    report = abuse.run(target, phase_s=2.0, only=["n_x_max_tokens"], profile=(os.getpid(), tmp_path))
    for name, phase in report["phases"].items():
        profile = phase["server_profile"]
        assert (tmp_path / f"{name}.txt").exists() and profile["samples"] > 0, (name, profile)
        kernel = profile["kernel"]
        if server.config.engine_process == "separate":  # the step loop: the engine-core process's main thread
            threads, engine = {t["name"]: t for t in kernel["engine_core"]["threads"]}, "MainThread"
        else:
            threads, engine = {t["name"]: t for t in kernel["threads"]}, ENGINE_THREAD
        assert threads[engine]["cpu_cores"] > 0, kernel  # the victim streamed: the engine ran
        assert kernel["cpus"] == sorted(os.sched_getaffinity(0)) and kernel["others_on_those_cpus_cores"] >= 0
        assert phase["engine_cpu_ms_per_victim_token"] > 0 and phase["engine_core_wait_ms_per_victim_token"] >= 0
    text = profile_text(report)
    assert "kernel: server tree" in text
    assert ("engine core: CPUs" in text) if server.config.engine_process == "separate" else (ENGINE_THREAD in text)
