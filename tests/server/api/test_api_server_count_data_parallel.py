"""--api-server-count 2 with --data-parallel-size 2 through the real CLI: two front-end processes on one
port, each with its own channel to both engine cores. Concurrent tenants on several adapters get the
greedy tokens a single-engine server gives, whichever front end and core served them; both front ends
and both cores serve; each tenant's usage is exactly what its responses reported; and a tenant's
requests-per-minute, tokens-per-minute and concurrency quotas hold across all of them (two front ends
times two cores is not four quotas). A killed core is restarted by the parent at its address for both
front ends while the other core keeps serving. The reference server, then one two-by-two server for
both tests, on one data directory."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from server.engine.core.process import PROCESS_NAME as CORE_PROCESS_NAME
from tests.server.api.test_api_server_count import (PROMPTS, Serving, _greedy, _recorded, _serve, _text,
                                                     _usage_total)
from tests.server.test_cli_start_stop import _stop

ADAPTERS = ("loraplex-demo", "demo-r4", "demo-r8", "demo-r16-rslora", "demo-pattern")
LONG = ("--max-model-len", "2048", "--kv-cache-blocks", "256")  # a stream that outlasts the quota checks


def _tenant(base: str, admin: dict, name: str, quota: dict) -> str:
    assert httpx.post(f"{base}/admin/tenants", headers=admin, json={"name": name, "quota": quota}).status_code == 201
    return httpx.post(f"{base}/admin/tenants/{name}/keys", headers=admin).json()["key"]


def _usage_of(jobs: list, responses: list[httpx.Response], key: str) -> tuple[int, int, int]:
    mine = [r.json()["usage"] for (k, _, _), r in zip(jobs, responses) if k == key]
    return len(mine), sum(u["prompt_tokens"] for u in mine), sum(u["completion_tokens"] for u in mine)


def _codes(base: str, key: str, count: int, max_tokens: int) -> list[int]:
    def one(_) -> int:
        with httpx.Client(base_url=base, timeout=120) as c:
            return c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "loraplex-demo", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True}).status_code

    with ThreadPoolExecutor(count) as pool:
        return sorted(pool.map(one, range(count)))


def _hold_stream(base: str, key: str, started: threading.Event, stop: threading.Event) -> None:
    """A long stream that holds one of the tenant's concurrency slots until `stop` (then closed)."""
    body = {"model": "loraplex-demo", "prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base, timeout=120) as c, \
            c.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                if stop.is_set():
                    return


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-count-dp")


@pytest.fixture(scope="module")
def one_engine(served_dir) -> dict[tuple[str, str], str]:
    """The reference: one front end, one engine core, on the data directory (demo model, demo key) the
    two-by-two server then serves."""
    proc, base, err = _serve(served_dir, *LONG)
    try:
        jobs = [((served_dir / "data" / "demo-key").read_text().strip(), m, p) for m in ADAPTERS for p in PROMPTS]
        return {(m, str(p)): _text(r) for (_, m, p), r in zip(jobs, _greedy(base, jobs))}
    finally:
        assert _stop(proc, signal.SIGTERM) == 0, err.read_text()


@pytest.fixture(scope="module")
def two_by_two(served_dir, one_engine) -> Iterator[Serving]:
    """One server with two front ends over two engine cores for the module's tests (the restart test last)."""
    proc, base, err = _serve(served_dir, "--api-server-count", "2", "--data-parallel-size", "2", *LONG)
    try:
        yield Serving(proc, base, err, served_dir / "data")
    finally:
        assert _stop(proc, signal.SIGTERM) == 0, err.read_text()


def test_two_front_ends_over_two_engine_cores(two_by_two, one_engine):
    base, err, demo_key, admin = two_by_two.base, two_by_two.err, two_by_two.demo_key, two_by_two.admin
    assert re.search(r"2 front ends \(pids \d+, \d+\) share 2 engine cores", err.read_text()), err.read_text()
    keys = {name: _tenant(base, admin, name, {}) for name in ("alpha", "beta")}

    # the demo tenant's usage so far: the reference server's requests (settled: it stopped)
    earlier = _usage_total(base, demo_key)
    # the demo tenant on five adapters and two tenants on the base, all at once
    jobs = [(demo_key, m, p) for m in ADAPTERS for p in PROMPTS] * 2
    jobs += [(keys[t], "loraplex-demo", p) for t in ("alpha", "beta") for p in PROMPTS] * 2
    responses = _greedy(base, jobs)
    texts = [_text(r) for r in responses]
    assert {r.headers["x-loraplex-front-end"] for r in responses} == {"0", "1"}
    by_job: dict[str, set[str]] = {}
    for (_, model, prompt), text in zip(jobs, texts):
        by_job.setdefault(f"{model}:{prompt}", set()).add(text)
    assert all(len(t) == 1 for t in by_job.values()), by_job
    for (model, prompt), text in one_engine.items():
        assert by_job[f"{model}:{prompt}"] == {text}, (model, prompt)
    for key in keys.values():
        reported = _usage_of(jobs, responses, key)
        assert _recorded(base, key, reported) == reported
    expected = tuple(a + b for a, b in zip(earlier, _usage_of(jobs, responses, demo_key)))
    assert _recorded(base, demo_key, expected) == expected
    engines = httpx.get(f"{base}/admin/engine", headers=admin).json()["engines"]
    # counted by the cores themselves, whichever front end sent the requests
    assert [e["engine"] for e in engines] == [0, 1]
    assert all(e["slots"]["hits"] + e["slots"]["misses"] > 0 for e in engines), engines

    rpm = _tenant(base, admin, "rpm", {"requests_per_minute": 4})
    assert _codes(base, rpm, 12, 4) == [200] * 4 + [429] * 8
    # an estimate of 4 prompt + 16 completion tokens each: three fit in 70 a minute
    tpm = _tenant(base, admin, "tpm", {"tokens_per_minute": 70})
    assert _codes(base, tpm, 8, 16) == [200] * 3 + [429] * 5
    # two concurrent requests: two streams (one per core, or both on one) hold them, on any front end
    conc = _tenant(base, admin, "conc", {"max_concurrent_requests": 2})
    stop = threading.Event()
    holders = []
    for _ in range(2):
        started = threading.Event()
        holder = threading.Thread(target=_hold_stream, args=(base, conc, started, stop), daemon=True)
        holder.start()
        assert started.wait(120)
        holders.append(holder)
    assert _codes(base, conc, 6, 2) == [429] * 6
    stop.set()
    for holder in holders:
        holder.join(120)


def _core_pids(parent: int) -> set[int]:
    return {c.pid for c in psutil.Process(parent).children(recursive=True) if c.name() == CORE_PROCESS_NAME}


def test_a_killed_core_is_restarted_for_both_front_ends_while_the_other_serves(two_by_two):
    proc, base, err = two_by_two.proc, two_by_two.base, two_by_two.err
    jobs = [(two_by_two.demo_key, m, p) for m in ADAPTERS for p in PROMPTS]
    before = [_text(r) for r in _greedy(base, jobs)]
    cores = _core_pids(proc.pid)
    assert len(cores) == 2, cores
    victim = min(cores)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # a 503 only for requests routed to the killed core before its death was noticed
        after = _greedy(base, jobs)
        codes = {r.status_code for r in after}
        assert codes <= {200, 503}, [r.text for r in after]
        if codes == {200} and len(_core_pids(proc.pid)) == 2:
            break
        assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
        time.sleep(0.5)
    assert [_text(r) for r in after] == before
    assert {r.headers["x-loraplex-front-end"] for r in after} == {"0", "1"}
    now = _core_pids(proc.pid)
    assert victim not in now and len(now & cores) == 1, (cores, now)
    assert err.read_text().count("starting a new one at the same address") == 1, err.read_text()
