"""--api-server-count 2 through the real CLI: two front-end processes on one port share one engine core.
Concurrent tenants get the greedy outputs a one-front-end server gives, both front ends serve requests
(x-loraplex-front-end), each tenant's usage is exactly what its responses reported, a requests-per-
minute quota holds across both front ends, and SIGTERM to the parent drains (a running stream ends in
full) and stops every process. A killed core is restarted by the parent for both front ends.
Without --engine-process separate the flag is refused in one line. One two-front-end server (and the
one-front-end reference before it, on the same data directory) serves the module's tests in order: the
restart test kills its core, the last test stops it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from server.embedded_redis.server import free_port
from server.engine.core.process import PROCESS_NAME as CORE_PROCESS_NAME
from tests.fixtures_server import read_sse
from tests.repo import ROOT_DIR as ROOT
from tests.server.test_cli_start_stop import _start, _stop

PROMPTS = ("once upon a time", "the quick brown", [5, 6, 7, 8], "hello")
QUOTA_RPM = 4


def _serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    proc, _, err = _start(tmp_path, port, *args)
    return proc, f"http://127.0.0.1:{port}", err


def _complete(base: str, key: str, model: str, prompt) -> httpx.Response:
    """One request on a connection of its own (the kernel picks a front end per connection)."""
    with httpx.Client(base_url=base, timeout=120) as c:
        return c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})


def _greedy(base: str, jobs: list[tuple[str, str, object]]) -> list[httpx.Response]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: _complete(base, *job), jobs))


def _demo_jobs(key: str) -> list[tuple[str, str, object]]:
    return [(key, model, prompt) for model in ("loraplex-demo", "demo-r8") for prompt in PROMPTS]


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _usage_total(base: str, key: str) -> tuple[int, int, int]:
    """(requests, prompt tokens, completion tokens) in the tenant's usage now."""
    r = httpx.get(f"{base}/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    total = r.json()["total"]
    return total["requests"], total["prompt_tokens"], total["completion_tokens"]


def _recorded(base: str, key: str, expected: tuple[int, int, int]) -> tuple[int, int, int]:
    """The tenant's usage totals once they reach `expected` (a request's usage is written as it ends,
    possibly just after its response), or as they are after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        seen = _usage_total(base, key)
        if seen == expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


@dataclass(frozen=True)
class Serving:
    """A running `serve` (the parent process) and its data directory's credentials."""
    proc: subprocess.Popen
    base: str
    err: Path
    data: Path

    @property
    def demo_key(self) -> str:
        return (self.data / "demo-key").read_text().strip()

    @property
    def admin(self) -> dict:
        return {"Authorization": "Bearer " + (self.data / "admin-token").read_text().strip()}


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-count")


@pytest.fixture(scope="module")
def one_front_end(served_dir) -> dict[tuple[str, str], str]:
    """The reference: the demo's greedy texts from one front end (serve's defaults otherwise), on the data
    directory (demo model, demo key) the two-front-end server then serves."""
    proc, base, _ = _serve(served_dir)
    try:
        jobs = _demo_jobs((served_dir / "data" / "demo-key").read_text().strip())
        return {(m, str(p)): _text(r) for (_, m, p), r in zip(jobs, _greedy(base, jobs))}
    finally:
        assert _stop(proc, signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def two_front_ends(served_dir, one_front_end) -> Iterator[Serving]:
    """One --api-server-count 2 server for the module: its tests run in order, and the last one stops it
    with SIGTERM (the fixture stops it so only if that test did not run)."""
    proc, base, err = _serve(served_dir, "--engine-process", "separate", "--api-server-count", "2")
    try:
        yield Serving(proc, base, err, served_dir / "data")
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGTERM)


def test_two_front_ends_share_one_core(two_front_ends, one_front_end):
    base, err, demo_key = two_front_ends.base, two_front_ends.err, two_front_ends.demo_key
    assert re.search(r"2 front ends \(pids \d+, \d+\) share one engine core", err.read_text()), err.read_text()
    keys = {}
    for name, quota in (("alpha", {}), ("beta", {}), ("capped", {"requests_per_minute": QUOTA_RPM})):
        assert httpx.post(f"{base}/admin/tenants", headers=two_front_ends.admin,
                          json={"name": name, "quota": quota}).status_code == 201
        keys[name] = httpx.post(f"{base}/admin/tenants/{name}/keys", headers=two_front_ends.admin).json()["key"]

    jobs = _demo_jobs(demo_key) + [(keys[t], "loraplex-demo", p) for t in ("alpha", "beta") for p in PROMPTS] * 2
    responses = _greedy(base, jobs)
    texts = [_text(r) for r in responses]
    served_by = {r.headers["x-loraplex-front-end"] for r in responses}
    assert served_by == {"0", "1"}, served_by
    # the same prompt gives the same tokens whichever tenant and front end sent it
    by_prompt: dict[str, set[str]] = {}
    for (_, model, prompt), text in zip(jobs, texts):
        by_prompt.setdefault(f"{model}:{prompt}", set()).add(text)
    assert all(len(t) == 1 for t in by_prompt.values()), by_prompt
    for tenant in ("alpha", "beta"):
        mine = [r.json()["usage"] for (k, _, _), r in zip(jobs, responses) if k == keys[tenant]]
        reported = (len(mine), sum(u["prompt_tokens"] for u in mine), sum(u["completion_tokens"] for u in mine))
        assert _recorded(base, keys[tenant], reported) == reported

    capped = _greedy(base, [(keys["capped"], "loraplex-demo", "hi")] * (3 * QUOTA_RPM))
    codes = sorted(r.status_code for r in capped)
    assert codes == [200] * QUOTA_RPM + [429] * (2 * QUOTA_RPM), codes
    assert {r.headers["x-loraplex-front-end"] for r in capped} == {"0", "1"}
    split = {(m, str(p)): t for (k, m, p), t in zip(jobs, texts) if k == demo_key}
    assert split == one_front_end


def _core_pid(parent: int) -> int:
    # the first is forked by serve, a restarted one by the core fork server: a grandchild
    cores = [c for c in psutil.Process(parent).children(recursive=True) if c.name() == CORE_PROCESS_NAME]
    assert len(cores) == 1, cores
    return cores[0].pid


def test_the_parent_restarts_a_killed_core_for_every_front_end(two_front_ends):
    proc, base, err = two_front_ends.proc, two_front_ends.base, two_front_ends.err
    jobs = [(two_front_ends.demo_key, "demo-r8", prompt) for prompt in PROMPTS] * 4
    before = [_text(r) for r in _greedy(base, jobs)]
    old = _core_pid(proc.pid)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # each front end sees the new core once its heartbeat lapsed and the core is ready
        after = _greedy(base, jobs)
        if all(r.status_code == 200 for r in after):
            break
        assert {r.status_code for r in after} <= {200, 503}, [r.text for r in after]
        assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
        time.sleep(0.5)
    assert [_text(r) for r in after] == before
    assert {r.headers["x-loraplex-front-end"] for r in after} == {"0", "1"}
    assert _core_pid(proc.pid) != old
    assert "starting a new one at the same address" in err.read_text()


def test_sigterm_to_the_parent_drains_both_front_ends_and_stops_every_process(two_front_ends):
    """Last in the module: it stops the shared server. A stream running on either front end still ends in
    full, and the core (a restarted one), both front ends and Redis are gone."""
    proc, base, err = two_front_ends.proc, two_front_ends.base, two_front_ends.err
    children = psutil.Process(proc.pid).children(recursive=True)
    events, first = [], threading.Event()
    body = {"model": "demo-r8", "prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}
    reader = threading.Thread(target=read_sse, args=(f"{base}/v1/completions",
                                                     {"Authorization": f"Bearer {two_front_ends.demo_key}"}, body,
                                                     events, first),
                              daemon=True)
    reader.start()
    try:
        assert first.wait(60)
    finally:
        status = _stop(proc, signal.SIGTERM)
    assert status == 0, err.read_text()
    reader.join(10)
    assert events[-2:] == ["[DONE]", "closed"], events[-3:]
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert err.read_text().count("SIGTERM received: stopping (running requests get") == 2  # each front end
    # the core, both front ends, Redis and multiprocessing's helpers (which may exit just after the parent)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def test_more_than_one_front_end_needs_a_separate_core(tmp_path):
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", "demo", "--port", str(free_port()),
                        "--data-dir", str(tmp_path / "data"), "--api-server-count", "2",
                        "--engine-process", "in-process"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-server-count 2" in lines[0] and "--engine-process separate" in lines[0], r.stderr
