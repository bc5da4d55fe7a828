"""A victim tenant's view of an attack (the abuse and schema-flood benches): phases run in turn, each
for `phase_s` seconds, a quiet baseline first; throughout, the victim streams greedy completions one
after another and records every inter-token gap, and a poller times GET /health. Each attack phase
runs its request loops in processes of their own (optionally pinned to CPUs of their own), so the
attacker's client work never delays the victim's clock."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from server.bench.cpu_pinning import pin_cpus
from server.bench.metrics import percentile, ratio
from server.bench.server_proc import ServerProcess
from server.bench.server_profile import Sampler, profile_lines, summarize
from server.config import ServerConfig

VICTIM_TOKENS = 64
HEALTH_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Target:
    url: str
    admin_token: str
    model: str
    max_model_len: int
    max_logprob_entries: int  # the server's --max-logprob-entries


@contextlib.contextmanager
def victim_server(work: Path, model: str | None, serve_args: list[str],
                  pin: bool) -> Iterator[tuple[ServerProcess, Target, tuple[int, ...] | None]]:
    """`loraplex serve` on `model` (default: the demo model, built under `work`) with a fresh Redis under
    `work`: (the server, its Target, the attacker's CPUs). With `pin` (2+ CPUs) every thread of the server
    and what it starts later run on the first CPU, and this process (the victim and /health poller, and
    the attacker processes it starts) on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    assert not pin or len(cpus) >= 2, "pinning needs 2 or more CPUs"
    if model is None:
        from server.demo import ensure_demo
        model = str(ensure_demo(work / "demo").model_dir)
    attacker_cpus = tuple(cpus[1:]) if pin else None
    shutil.rmtree(work / "data", ignore_errors=True)  # a fresh Redis: no tenants of an earlier run
    with ServerProcess(work / "data", work / "server.log", model_dir=Path(model),
                       serve_args=["--device", "cpu", *serve_args]) as srv:
        if pin:
            subprocess.run(["taskset", "-a", "-cp", str(cpus[0]), str(srv.proc.pid)], check=True,
                           capture_output=True)
            os.sched_setaffinity(0, attacker_cpus)
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        httpx.post(srv.url + "/admin/tenants", json={"name": "probe"}, headers=admin).raise_for_status()
        key = httpx.post(srv.url + "/admin/tenants/probe/keys", headers=admin).json()["key"]
        card = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]
        yield srv, Target(srv.url, srv.admin_token, card["id"], card["max_model_len"],
                          ServerConfig.max_logprob_entries), attacker_cpus


@dataclass
class Phase:
    name: str
    gaps_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    victim_errors: int = 0
    profile: dict | None = None  # server_profile.summarize of the server's CPU in this phase

    def summary(self, baseline: "Phase | None") -> dict:
        """The victim's latencies in this phase (and, against the baseline, its p99 ITL ratio)."""
        p99 = percentile(self.gaps_s, 99)
        out = {"victim_itl_p50_ms": _ms(percentile(self.gaps_s, 50)), "victim_itl_p99_ms": _ms(p99),
               "victim_gaps": len(self.gaps_s), "victim_errors": self.victim_errors,
               "health_p50_ms": _ms(percentile(self.health_s, 50)), "health_p99_ms": _ms(percentile(self.health_s, 99)),
               "health_max_ms": _ms(max(self.health_s, default=None)), "health_probes": len(self.health_s),
               "attack_statuses": {str(k): v for k, v in sorted(self.statuses.items())}}
        if baseline is not None:
            r = ratio(p99, percentile(baseline.gaps_s, 99))
            out["itl_p99_vs_baseline"] = None if r is None else round(r, 3)
        if self.profile is not None:
            out["server_profile"] = self.profile
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def client(target: Target, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=target.url, headers=headers, timeout=300)


def new_tenant(target: Target, name: str, quota: dict) -> str:
    """A fresh tenant's API key."""
    with client(target, target.admin_token) as c:
        r = c.post("/admin/tenants", json={"name": name, "quota": quota})
        assert r.status_code == 201, r.text
        r = c.post(f"/admin/tenants/{name}/keys")
        assert r.status_code == 201, r.text
        return r.json()["key"]


def _victim(target: Target, key: str, phase: Callable[[], Phase], stop: threading.Event) -> None:
    body = {"model": target.model, "prompt": [11, 42, 97, 5, 64, 23], "max_tokens": VICTIM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with client(target, key) as c:
        while not stop.is_set():
            current, last = phase(), None
            try:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        current.victim_errors += 1
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        if last is not None and phase() is current:
                            current.gaps_s.append(now - last)
                        last = now
            except httpx.HTTPError:
                current.victim_errors += 1


def _health(target: Target, phase: Callable[[], Phase], stop: threading.Event) -> None:
    with client(target, None) as c:
        while not stop.is_set():
            current, start = phase(), time.perf_counter()
            try:
                c.get("/health")
                current.health_s.append(time.perf_counter() - start)
            except httpx.HTTPError:
                current.health_s.append(float("inf"))
            time.sleep(HEALTH_INTERVAL_S)


def run_phases(target: Target, victim_key: str, attacks: list[str], phase_s: float, workers: int,
               attack: Callable[[str, ProcessPoolExecutor], list[Future]],
               attacker_cpus: tuple[int, ...] | None = None,
               log: Callable[[str], None] = lambda s: None,
               profile: tuple[int, Path] | None = None) -> list[Phase]:
    """The baseline, then each named attack for phase_s seconds while the victim streams. `attack(name,
    pool)` starts the phase's request loops on the pool (each returns a Counter of statuses).
    With `profile` = (server pid, directory), py-spy samples the server through each phase into
    `<directory>/<phase>.txt` and the phase keeps the summary. Returns the phases, the baseline first."""
    phases = [Phase("baseline")] + [Phase(n) for n in attacks]
    current = [phases[0]]
    stop = threading.Event()
    background = [threading.Thread(target=_victim, args=(target, victim_key, lambda: current[0], stop)),
                  threading.Thread(target=_health, args=(target, lambda: current[0], stop))]
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=pin_cpus, initargs=(attacker_cpus,))
    for t in background:
        t.start()
    try:
        for phase in phases:
            log(f"phase {phase.name} ({phase_s:.0f} s)")
            with _sampled(phase, profile):
                current[0] = phase
                if phase.name == "baseline":
                    time.sleep(phase_s)
                    continue
                for loop in attack(phase.name, pool):
                    phase.statuses.update(loop.result())
            time.sleep(0.5)  # the attack's last requests drain before the next phase is measured
    finally:
        stop.set()
        for t in background:
            t.join(300)
        pool.shutdown()
    return phases


@contextlib.contextmanager
def _sampled(phase: Phase, profile: tuple[int, Path] | None) -> Iterator[None]:
    """Runs the phase's body, sampled by py-spy when `profile` is (server pid, directory)."""
    if profile is None:
        yield
        return
    pid, directory = profile
    out, start = directory / f"{phase.name}.txt", time.perf_counter()
    with Sampler(pid, out) as sampler:
        yield
    phase.profile = summarize(out, time.perf_counter() - start, sampler.rate)


def profile_text(report: dict) -> str:
    """The server's CPU by category in each profiled phase of a report (empty when none was)."""
    lines = []
    for name, s in report["phases"].items():
        if "server_profile" in s:
            lines += profile_lines(name, s["server_profile"])
    return "\n".join(lines)
