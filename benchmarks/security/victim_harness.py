"""A victim tenant's view of an attack (the abuse and schema-flood benches): phases run in turn, each
for `phase_s` seconds, a quiet baseline first; throughout, the victim streams greedy completions one
after another and records every inter-token gap, and a poller times GET /health. Each attack phase
runs its request loops in processes of their own (optionally pinned to CPUs of their own), so the
attacker's client work never delays the victim's clock."""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.profile import core_share, thread_times
from benchmarks.profile.cpu_pinning import pin_cpus, pin_process
from benchmarks.profile.server_profile import ENGINE_THREAD, Sampler, can_profile, profile_lines, summarize
from server.bench.metrics import percentile, ratio
from server.bench.server_proc import ServerProcess
from server.config import ServerConfig

VICTIM_TOKENS = 64
HEALTH_INTERVAL_S = 0.05
QUIET_CORES = 0.25  # the server counts as settled once its tree uses less CPU than this over a second
SETTLE_TIMEOUT_S = 300.0
PROBE_DELAY_S = 2.0


@dataclass(frozen=True)
class Target:
    url: str
    admin_token: str
    model: str
    max_model_len: int
    max_logprob_entries: int  # the server's --max-logprob-entries
    fetch_timeout_s: float = ServerConfig.adapter_fetch_timeout  # its --adapter-fetch-timeout
    compile_deadline_s: float = ServerConfig.max_grammar_compile_ms / 1000  # its --max-grammar-compile-ms


@dataclass
class LoopResult:
    """What one attacker request loop saw: the statuses of its requests and the longest one took."""
    statuses: Counter = field(default_factory=Counter)
    longest_s: float = 0.0


def add_victim_server_args(p: argparse.ArgumentParser, work_dir: str, serve_arg_example: str) -> None:
    """The options of every victim bench (abuse, schema flood): the model, phase length, pinning, where
    the run's files go, the report, the profile and extra `loraplex serve` arguments."""
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default 20)")
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--pin", action="store_true",
                     help="server on CPU 0, attacker and victim clients on the rest (default: no pinning)")
    pin.add_argument("--pin-engine", action="store_true",
                     help="the server's own CPU placement: its engine on CPU 0 (--engine-cpus), its front end, "
                          "compile and loader processes on the rest (--api-cpus), with the attacker and victim "
                          "clients (default: no pinning)")
    p.add_argument("--work-dir", default=work_dir, help=f"demo model, Redis data, server log (default {work_dir})")
    p.add_argument("--json", default=None, help="write the report here (default: print only)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="sample the server with py-spy through each phase (raw stacks in DIR/<phase>.txt) and "
                        "report its CPU by category, with the kernel's per-thread CPU and wait for a core and "
                        "what other processes took of the server's CPUs (default: off)")
    p.add_argument("--attacker-nice", type=int, default=0, metavar="N",
                   help="run the attacker's processes at nice N (they stand in for other machines; with N > 0 "
                        "they take only the CPU the server and the victim leave; default 0)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="the engine's per-step trace (LORAPLEX_STEP_TRACE, server.engine.step_trace) in DIR/steps.jsonl "
                        "and each phase's victim gaps and requests, on the same clock, in DIR/<phase>-victim.json "
                        "(default: off)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help=f"extra `loraplex serve` argument, repeatable (e.g. --serve-arg={serve_arg_example})")


def check_victim_server_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through p.error when --pin or --profile cannot be had on this machine."""
    if (args.pin or args.pin_engine) and len(os.sched_getaffinity(0)) < 2:
        p.error("--pin and --pin-engine need 2 or more CPUs")
    if args.profile and can_profile() is not None:
        p.error(f"--profile: {can_profile()}")


@contextlib.contextmanager
def victim_server(work: Path, model: str | None, serve_args: list[str],
                  pin: bool, pin_engine: bool = False, trace: Path | None = None) -> Iterator[tuple[ServerProcess, Target, tuple[int, ...] | None]]:
    """`loraplex serve` on `model` (default: the demo model, built under `work`) with a fresh Redis under
    `work`: (the server, its Target, the attacker's CPUs). With `pin` (2+ CPUs) every thread of the server
    and what it starts later run on the first CPU, and this process (the victim and /health poller, and
    the attacker processes it starts) on the others. With `pin_engine` the server places itself
    (server.cpu_placement): its engine on the first CPU, the rest of it with this process on the others.
    With `trace`, the engine writes its step trace to trace/steps.jsonl (server.engine.step_trace)."""
    cpus = sorted(os.sched_getaffinity(0))
    assert not (pin or pin_engine) or len(cpus) >= 2, "pinning needs 2 or more CPUs"
    if model is None:
        from server.demo import ensure_demo
        model = str(ensure_demo(work / "demo").model_dir)
    attacker_cpus = tuple(cpus[1:]) if pin or pin_engine else None
    if pin_engine:
        serve_args = [*serve_args, "--engine-cpus", str(cpus[0]), "--api-cpus", ",".join(map(str, cpus[1:]))]
    shutil.rmtree(work / "data", ignore_errors=True)  # a fresh Redis: no tenants of an earlier run
    if trace is not None:
        # here, not at the top: the attacker processes import this module, and server.engine loads torch
        # (seconds in each, longer than a rate window in the tests)
        from server.engine.step_trace import TRACE_ENV

        trace.mkdir(parents=True, exist_ok=True)
        os.environ[TRACE_ENV] = str(trace / "steps.jsonl")  # the server's environment is a copy of this one
    with ServerProcess(work / "data", work / "server.log", model_dir=Path(model),
                       serve_args=["--device", "cpu", *serve_args]) as srv:
        if pin:
            subprocess.run(["taskset", "-a", "-cp", str(cpus[0]), str(srv.proc.pid)], check=True,
                           capture_output=True)
        if attacker_cpus:
            os.sched_setaffinity(0, attacker_cpus)
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        httpx.post(srv.url + "/admin/tenants", json={"name": "probe"}, headers=admin).raise_for_status()
        key = httpx.post(srv.url + "/admin/tenants/probe/keys", headers=admin).json()["key"]
        probe = {"Authorization": f"Bearer {key}"}
        card = httpx.get(srv.url + "/v1/models", headers=probe).json()["data"][0]
        # Start-up work the server does in the background ends before the baseline: one constrained
        # request waits for the grammar compile pool (its fork server imports xgrammar and torch at a
        # low priority, a minute on a busy machine), then the server's CPU settles.
        httpx.post(srv.url + "/v1/completions", headers=probe, timeout=SETTLE_TIMEOUT_S, json={
            "model": card["id"], "prompt": "x", "max_tokens": 1, "guided_choice": ["warm"]}).raise_for_status()
        if pin:
            # The compile fork server starts right after the server is ready, maybe before the taskset
            # above: it and its processes go on the server's core too (those it forks later inherit its
            # mask). Redis stays where it started, as in earlier runs.
            for pid in core_share.tree(srv.proc.pid)[1:]:
                with contextlib.suppress(OSError):  # a process that ended meanwhile
                    if Path(f"/proc/{pid}/comm").read_text().strip() != "redis-server":
                        pin_process(pid, cpus[0])
        if sys.platform == "linux":
            settle(srv.proc.pid)
        yield srv, Target(srv.url, srv.admin_token, card["id"], card["max_model_len"],
                          ServerConfig.max_logprob_entries), attacker_cpus


def settle(pid: int) -> None:
    """Wait until the server's CPU is quiet (start-up work in the background would otherwise land in
    the baseline), at most SETTLE_TIMEOUT_S."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        before = core_share.tree_cpu_s(core_share.snapshot(pid))
        time.sleep(1.0)
        if core_share.tree_cpu_s(core_share.snapshot(pid)) - before < QUIET_CORES:
            return


@dataclass
class Phase:
    name: str
    gaps_s: list[float] = field(default_factory=list)
    gap_ends: list[float] = field(default_factory=list)  # perf_counter at the end of each gap in gaps_s
    victim_requests: list[tuple[float, float | None]] = field(default_factory=list)  # (sent, first token) each
    health_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    victim_errors: int = 0
    attacker_longest_s: float | None = None  # the attacker's longest request (None: no attacker)
    probes: dict = field(default_factory=dict)  # the victim's one-off requests during the phase (run_phases' probe)
    profile: dict | None = None  # server_profile.summarize of the server's CPU in this phase

    def summary(self, baseline: "Phase | None") -> dict:
        """The victim's latencies in this phase (and, against the baseline, its p99 ITL ratio)."""
        p99 = percentile(self.gaps_s, 99)
        out = {"victim_itl_p50_ms": _ms(percentile(self.gaps_s, 50)), "victim_itl_p99_ms": _ms(p99),
               "victim_gaps": len(self.gaps_s), "victim_errors": self.victim_errors,
               "health_p50_ms": _ms(percentile(self.health_s, 50)), "health_p99_ms": _ms(percentile(self.health_s, 99)),
               "health_max_ms": _ms(max(self.health_s, default=None)), "health_probes": len(self.health_s),
               "attack_statuses": {str(k): v for k, v in sorted(self.statuses.items())},
               "attacker_longest_s": None if self.attacker_longest_s is None else round(self.attacker_longest_s, 3)}
        if self.probes:
            out["victim_probes"] = self.probes
        if baseline is not None:
            r = ratio(p99, percentile(baseline.gaps_s, 99))
            out["itl_p99_vs_baseline"] = None if r is None else round(r, 3)
        if self.profile is not None:
            out["server_profile"] = self.profile
            kernel = self.profile.get("kernel") or {}
            engine = next((t for t in kernel.get("threads", []) if t["name"] == ENGINE_THREAD), None)
            if "engine_core" in kernel:  # the step loop runs on the engine-core process's main thread
                engine = next((t for t in kernel["engine_core"]["threads"] if t["name"] == "MainThread"), None)
            if engine is not None and self.gaps_s:
                # the engine's CPU and its wait for the core per token the victim got (each victim token
                # is one engine step; steps without the victim are few: it always has a request running)
                per_token = self.profile["kernel"]["wall_s"] * 1000 / len(self.gaps_s)
                out["engine_cpu_ms_per_victim_token"] = round(engine["cpu_cores"] * per_token, 2)
                out["engine_core_wait_ms_per_victim_token"] = round(engine["runnable_waiting"] * per_token, 2)
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
            sent = time.perf_counter()
            try:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        current.victim_errors += 1
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        if last is None and phase() is current:
                            current.victim_requests.append((sent, now))
                        if last is not None and phase() is current:
                            current.gaps_s.append(now - last)
                            current.gap_ends.append(now)
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
               profile: tuple[int, Path] | None = None,
               probe: Callable[[str], dict] | None = None, attacker_nice: int = 0,
               trace: Path | None = None) -> list[Phase]:
    """The baseline, then each named attack for phase_s seconds while the victim streams. `attack(name,
    pool)` starts the phase's request loops on the pool (each returns a LoopResult).
    With `profile` = (server pid, directory), py-spy samples the server through each phase into
    `<directory>/<phase>.txt` and the phase keeps the summary. With `probe`, `probe(phase name)` runs
    once in each phase (the baseline too), PROBE_DELAY_S into it (a quarter of shorter phases), once the
    attack is under way; the phase keeps what it returns. With `trace`, each phase's victim gaps and requests
    go to `<trace>/<phase>-victim.json` (perf_counter times, the engine's step trace's clock). Returns the
    phases, the baseline first."""
    phases = [Phase("baseline")] + [Phase(n) for n in attacks]
    current = [phases[0]]
    stop = threading.Event()
    background = [threading.Thread(target=_victim, args=(target, victim_key, lambda: current[0], stop)),
                  threading.Thread(target=_health, args=(target, lambda: current[0], stop))]
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=pin_cpus, initargs=(attacker_cpus, attacker_nice))
    # Every attacker process starts now, not inside the first attack phase (a phase's probe would
    # otherwise run while its attack is still starting).
    list(pool.map(time.sleep, [0.2] * workers))
    for t in background:
        t.start()
    try:
        for phase in phases:
            log(f"phase {phase.name} ({phase_s:.0f} s)")
            with _sampled(phase, profile):
                current[0] = phase
                started, clock = time.monotonic(), time.perf_counter()
                loops = [] if phase.name == "baseline" else attack(phase.name, pool)
                if probe is not None:
                    time.sleep(min(PROBE_DELAY_S, phase_s / 4))
                    phase.probes = probe(phase.name)
                if phase.name == "baseline":
                    time.sleep(max(0.0, phase_s - (time.monotonic() - started)))
                for loop in loops:
                    result = loop.result()
                    phase.statuses.update(result.statuses)
                    phase.attacker_longest_s = max(phase.attacker_longest_s or 0.0, result.longest_s)
            if trace is not None:
                (trace / f"{phase.name}-victim.json").write_text(json.dumps({
                    "start": clock, "end": time.perf_counter(), "gaps": list(zip(phase.gap_ends, phase.gaps_s)),
                    "requests": phase.victim_requests}))
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
    core = core_share.engine_core_pid(pid)
    with Sampler(pid, out) as sampler:
        kernel = [(time.perf_counter(), thread_times.snapshot(pid), core_share.snapshot(pid),
                   core and (thread_times.snapshot(core), core_share.snapshot(core)))]
        yield
        kernel.append((time.perf_counter(), thread_times.snapshot(pid), core_share.snapshot(pid),
                       core and (thread_times.snapshot(core), core_share.snapshot(core))))
    phase.profile = summarize(out, time.perf_counter() - start, sampler.rate, engine_core=core)
    (t0, threads0, share0, core0), (t1, threads1, share1, core1) = kernel
    names = thread_times.thread_names(out)
    phase.profile["kernel"] = {
        "wall_s": round(t1 - t0, 2), **core_share.phase_share(share0, share1, t1 - t0, pid),
        "threads": thread_times.phase_times(threads0, threads1, names, t1 - t0)}
    if core0 and core1:
        # --engine-process separate: the step loop is the engine-core process's main thread, on its own CPUs
        phase.profile["kernel"]["engine_core"] = {
            **core_share.phase_share(core0[1], core1[1], t1 - t0, core),
            "threads": thread_times.phase_times(core0[0], core1[0], names, t1 - t0)}


def profile_text(report: dict) -> str:
    """The server's CPU by category in each profiled phase of a report (empty when none was)."""
    lines = []
    for name, s in report["phases"].items():
        if "server_profile" in s:
            lines += profile_lines(name, s["server_profile"])
            k = s["server_profile"].get("kernel")
            if k:
                processes = ", ".join(f"{p} {v}" for p, v in k["processes"].items() if v)
                lines.append(f"  {name}: kernel: server tree {k['tree_cpu_cores']} cores ({processes}); CPUs "
                             f"{k['cpus']} busy {k['cpus_busy_cores']}, other processes {k['others_on_those_cpus_cores']}"
                             f"; engine per victim token: {s.get('engine_cpu_ms_per_victim_token')} ms CPU, "
                             f"{s.get('engine_core_wait_ms_per_victim_token')} ms waiting for the core")
                lines += thread_times.thread_lines(name, k["threads"][:10])
                core = k.get("engine_core")
                if core:
                    lines.append(f"  {name}: engine core: CPUs {core['cpus']} busy {core['cpus_busy_cores']}, its "
                                 f"process {core['tree_cpu_cores']} cores, other processes "
                                 f"{core['others_on_those_cpus_cores']}")
                    lines += thread_times.thread_lines(f"{name} (engine core)", core["threads"][:5])
    return "\n".join(lines)
