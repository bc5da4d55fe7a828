"""The abuse benchmark (issue 22): a victim tenant streams while another tenant attacks.

Phases run in turn, each for `phase_s` seconds: a quiet baseline, then each attack. Throughout,
the victim streams greedy completions one after another and records every inter-token gap, and
a poller times GET /health. The attacks are the ones seen to stall everyone: a 16 MB token-array
body (from a tenant within its quota and from one over it), /tokenize and /detokenize floods,
logprob-heavy echo requests (the 200 MB response, and the largest one the output budget allows),
and n x max_tokens batches past the tenant's per-request cap. Target: the victim's p99 ITL moves
by at most 20% against the baseline and /health p99 stays at most 100 ms.
"""
from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from server.bench.cpu_pinning import pin_cpus
from server.bench.metrics import percentile, ratio

ITL_TARGET_RATIO = 1.20
HEALTH_TARGET_S = 0.100
VICTIM_TOKENS = 64
HEALTH_INTERVAL_S = 0.05


@dataclass
class Phase:
    name: str
    gaps_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    victim_errors: int = 0

    def summary(self, baseline: "Phase | None") -> dict:
        p99 = percentile(self.gaps_s, 99)
        out = {"victim_itl_p50_ms": _ms(percentile(self.gaps_s, 50)), "victim_itl_p99_ms": _ms(p99),
               "victim_gaps": len(self.gaps_s), "victim_errors": self.victim_errors,
               "health_p50_ms": _ms(percentile(self.health_s, 50)), "health_p99_ms": _ms(percentile(self.health_s, 99)),
               "health_max_ms": _ms(max(self.health_s, default=None)), "health_probes": len(self.health_s),
               "attack_statuses": {str(k): v for k, v in sorted(self.statuses.items())}}
        if baseline is not None:
            out["itl_p99_vs_baseline"] = _round(ratio(p99, percentile(baseline.gaps_s, 99)))
            out["met"] = (out["itl_p99_vs_baseline"] is not None and out["itl_p99_vs_baseline"] <= ITL_TARGET_RATIO
                          and out["health_p99_ms"] is not None and out["health_p99_ms"] <= HEALTH_TARGET_S * 1000)
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


@dataclass(frozen=True)
class Target:
    url: str
    admin_token: str
    model: str
    max_model_len: int
    max_logprob_entries: int  # the server's --max-logprob-entries


def _client(target: Target, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=target.url, headers=headers, timeout=300)


def _tenant(target: Target, name: str, quota: dict) -> str:
    with _client(target, target.admin_token) as c:
        r = c.post("/admin/tenants", json={"name": name, "quota": quota})
        assert r.status_code == 201, r.text
        r = c.post(f"/admin/tenants/{name}/keys")
        assert r.status_code == 201, r.text
        return r.json()["key"]


def _victim(target: Target, key: str, phase: Callable[[], Phase], stop: threading.Event) -> None:
    body = {"model": target.model, "prompt": [11, 42, 97, 5, 64, 23], "max_tokens": VICTIM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with _client(target, key) as c:
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
    with _client(target, None) as c:
        while not stop.is_set():
            current, start = phase(), time.perf_counter()
            try:
                c.get("/health")
                current.health_s.append(time.perf_counter() - start)
            except httpx.HTTPError:
                current.health_s.append(float("inf"))
            time.sleep(HEALTH_INTERVAL_S)


@dataclass(frozen=True)
class Attack:
    tenant: str        # which attacker: "open" (no limits), "limited" (1 request a minute), "capped"
    loops: int         # parallel request loops
    path: str
    body: bytes        # encoded once: building it per request would load the attacker, not the server


def _attacks(target: Target) -> dict[str, Attack]:
    m, limit = target.model, target.max_model_len

    def body(obj: dict) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()
    huge = ('{"model":"%s","prompt":[%s],"max_tokens":1}' % (m, ",".join(["1234"] * 3_000_000))).encode()
    text = ("hello world " * limit)[:limit - 8]  # fits the context even at one token per character
    logprob_heavy = {"model": m, "prompt": [[5] * (limit - 2)] * 64, "max_tokens": 1, "echo": True,
                     "logprobs": 20, "prompt_logprobs": 20}
    # the largest echo the output budget lets through: prompts x (prompt tokens + 1) x 21 <= the budget
    fits = max(1, min(64, target.max_logprob_entries // ((limit - 1) * 21)))
    allowed = {**logprob_heavy, "prompt": [[5] * (limit - 2)] * fits, "prompt_logprobs": None}
    return {
        "huge_token_body": Attack("open", 1, "/v1/completions", huge),
        "huge_body_over_quota": Attack("limited", 1, "/v1/completions", huge),
        "tokenize_flood": Attack("open", 4, "/tokenize", body({"model": m, "prompt": text})),
        "detokenize_flood": Attack("open", 4, "/detokenize", body({"model": m, "tokens": [7] * limit})),
        "detokenize_2e20_ids": Attack("open", 2, "/detokenize", body({"model": m, "tokens": [7] * (1 << 20)})),
        "logprob_echo_200mb": Attack("open", 1, "/v1/completions", body(logprob_heavy)),
        "logprob_echo_in_budget": Attack("open", 1, "/v1/completions", body(allowed)),
        "n_x_max_tokens": Attack("capped", 2, "/v1/completions", body({
            "model": m, "prompt": ["hello"] * 64, "n": 16, "max_tokens": 10, "ignore_eos": True})),
    }


def _attack_loop(url: str, key: str, path: str, body: bytes, phase_s: float) -> Counter:
    """One attacker loop (in its own process, so its client work never delays the victim's clock)."""
    statuses: Counter = Counter()
    deadline = time.monotonic() + phase_s
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}",
                                             "Content-Type": "application/json"}, timeout=300) as c:
        while time.monotonic() < deadline:
            try:
                statuses[str(c.post(path, content=body).status_code)] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1
    return statuses


def run(target: Target, phase_s: float = 10.0, only: list[str] | None = None,
        log: Callable[[str], None] = lambda s: None, attacker_cpus: tuple[int, ...] | None = None) -> dict:
    """Run the baseline and each attack (or those named in `only`); returns the JSON report. The
    attacker's processes run on `attacker_cpus` (None: wherever the OS puts them)."""
    tag = str(int(time.time() * 1000))[-8:]
    keys = {"victim": _tenant(target, f"victim-{tag}", {}),
            "open": _tenant(target, f"open-{tag}", {}),
            "limited": _tenant(target, f"limited-{tag}", {"requests_per_minute": 1}),
            "capped": _tenant(target, f"capped-{tag}", {"max_tokens_per_request": 10})}
    attacks = _attacks(target)
    names = [n for n in attacks if only is None or n in only]
    phases = [Phase("baseline")] + [Phase(n) for n in names]
    current = [phases[0]]
    stop = threading.Event()
    background = [threading.Thread(target=_victim, args=(target, keys["victim"], lambda: current[0], stop)),
                  threading.Thread(target=_health, args=(target, lambda: current[0], stop))]
    pool = ProcessPoolExecutor(max_workers=max(a.loops for a in attacks.values()),
                               mp_context=multiprocessing.get_context("spawn"),
                               initializer=pin_cpus, initargs=(attacker_cpus,))
    for t in background:
        t.start()
    try:
        for phase in phases:
            current[0] = phase
            log(f"phase {phase.name} ({phase_s:.0f} s)")
            if phase.name == "baseline":
                time.sleep(phase_s)
                continue
            attack = attacks[phase.name]
            if attack.tenant == "limited":
                # Spend its one request a minute: refused requests never count, so only a tenant
                # that used its quota is over it (and then its bodies are refused unread).
                with _client(target, keys[attack.tenant]) as c:
                    c.post("/v1/completions", json={"model": target.model, "prompt": "hi", "max_tokens": 1})
            loops = [pool.submit(_attack_loop, target.url, keys[attack.tenant], attack.path, attack.body, phase_s)
                     for _ in range(attack.loops)]
            for loop in loops:
                phase.statuses.update(loop.result())
            time.sleep(0.5)  # the last attack request's work drains before the next phase is measured
    finally:
        stop.set()
        for t in background:
            t.join(300)
        pool.shutdown()
    baseline = phases[0]
    out = {"phase_s": phase_s, "victim_tokens_per_request": VICTIM_TOKENS,
           "targets": {"itl_p99_ratio": ITL_TARGET_RATIO, "health_p99_ms": HEALTH_TARGET_S * 1000},
           "phases": {p.name: p.summary(None if p is baseline else baseline) for p in phases}}
    out["met"] = all(s.get("met", True) for s in out["phases"].values())
    return out


def table(report: dict) -> str:
    rows = [("phase", "ITL p50 ms", "ITL p99 ms", "p99 vs base", "/health p99 ms", "/health max ms",
             "attack statuses", "met")]
    for name, s in report["phases"].items():
        rows.append((name, str(s["victim_itl_p50_ms"]), str(s["victim_itl_p99_ms"]),
                     str(s.get("itl_p99_vs_baseline", "-")), str(s["health_p99_ms"]), str(s["health_max_ms"]),
                     json.dumps(s["attack_statuses"]), str(s.get("met", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
