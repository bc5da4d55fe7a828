"""bench_refusal_cpu sends each body attack to a real server and counts the front end's CPU per request
(the numbers are timings, not asserted; the statuses are the routes' refusals)."""
from __future__ import annotations

import os

from benchmarks.security import bench_refusal_cpu
from benchmarks.security.victim_harness import Target
from tests.fixtures_server import api_redis_url, running_server, server_config


def test_each_attack_is_refused_and_measured(tmp_path, tiny_model_dir, redis_server):
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server), rate_window_seconds=60.0)
    with running_server(config) as server:
        target = Target(server.url, config.admin_token, server.state.model_id,
                        server.state.engine.info.max_model_len, config.max_logprob_entries)
        results = bench_refusal_cpu.run(os.getpid(), target, 2, list(bench_refusal_cpu.ATTACKS))
    assert {name: r["statuses"] for name, r in results.items()} == {
        "huge_token_body": {"400": 2}, "huge_body_over_quota": {"429": 2}, "detokenize_2e20_ids": {"400": 2},
        "logprob_echo_200mb": {"400": 2}}
    assert all(r["front_end_cpu_ms_per_request"] > 0 for r in results.values())
    assert "front-end CPU ms/request" in bench_refusal_cpu.table(results)
