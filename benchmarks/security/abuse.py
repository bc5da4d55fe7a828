"""The abuse benchmark (issue 22): a victim tenant streams while another tenant attacks.

Phases run in turn, each for `phase_s` seconds: a quiet baseline, then each attack. Throughout,
the victim streams greedy completions one after another and records every inter-token gap, and
a poller times GET /health. The attacks are the ones seen to stall everyone: a 16 MB token-array
body (from a tenant within its quota and from one over it), /tokenize and /detokenize floods,
logprob-heavy echo requests (the 200 MB response, and the largest one the output budget allows),
and n x max_tokens batches past the tenant's per-request cap, and grammars and regexes nesting
unbounded repetitions 40 deep (issue 43). Target: the victim's p99 ITL moves
by at most 20% against the baseline and /health p99 stays at most 100 ms.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.security.nested_constraints import nested_grammar, nested_regex
from benchmarks.security.victim_harness import VICTIM_TOKENS, Target, client, new_tenant, run_phases

ITL_TARGET_RATIO = 1.20
HEALTH_TARGET_S = 0.100


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
        # Issue 43: masks that grow costlier with every token (refused at compile now).
        "nested_grammar": Attack("open", 2, "/v1/completions", body({
            "model": m, "prompt": "hi", "max_tokens": 40, "min_tokens": 40, "guided_grammar": nested_grammar(40)})),
        "nested_regex": Attack("open", 2, "/v1/completions", body({
            "model": m, "prompt": "hi", "max_tokens": 40, "min_tokens": 40, "guided_regex": nested_regex(40)})),
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
        log: Callable[[str], None] = lambda s: None, attacker_cpus: tuple[int, ...] | None = None,
        profile: tuple[int, Path] | None = None) -> dict:
    """Run the baseline and each attack (or those named in `only`); returns the JSON report. The
    attacker's processes run on `attacker_cpus` (None: wherever the OS puts them)."""
    tag = str(int(time.time() * 1000))[-8:]
    keys = {"victim": new_tenant(target, f"victim-{tag}", {}),
            "open": new_tenant(target, f"open-{tag}", {}),
            "limited": new_tenant(target, f"limited-{tag}", {"requests_per_minute": 1}),
            "capped": new_tenant(target, f"capped-{tag}", {"max_tokens_per_request": 10})}
    attacks = _attacks(target)

    def start(name: str, pool: ProcessPoolExecutor) -> list[Future]:
        attack = attacks[name]
        if attack.tenant == "limited":
            # Spend its one request a minute: refused requests never count, so only a tenant
            # that used its quota is over it (and then its bodies are refused unread).
            with client(target, keys[attack.tenant]) as c:
                c.post("/v1/completions", json={"model": target.model, "prompt": "hi", "max_tokens": 1})
        return [pool.submit(_attack_loop, target.url, keys[attack.tenant], attack.path, attack.body, phase_s)
                for _ in range(attack.loops)]

    names = [n for n in attacks if only is None or n in only]
    phases = run_phases(target, keys["victim"], names, phase_s, max(a.loops for a in attacks.values()), start,
                        attacker_cpus, log, profile)
    baseline = phases[0]
    summaries = {}
    for p in phases:
        s = p.summary(None if p is baseline else baseline)
        if p is not baseline:
            s["met"] = (s["itl_p99_vs_baseline"] is not None and s["itl_p99_vs_baseline"] <= ITL_TARGET_RATIO
                        and s["health_p99_ms"] is not None and s["health_p99_ms"] <= HEALTH_TARGET_S * 1000)
        summaries[p.name] = s
    return {"phase_s": phase_s, "victim_tokens_per_request": VICTIM_TOKENS,
            "targets": {"itl_p99_ratio": ITL_TARGET_RATIO, "health_p99_ms": HEALTH_TARGET_S * 1000},
            "phases": summaries, "met": all(s.get("met", True) for s in summaries.values())}


def table(report: dict) -> str:
    # with --profile: what other processes took of the server's CPUs (the noise no attack explains)
    rows = [("phase", "ITL p50 ms", "ITL p99 ms", "p99 vs base", "/health p99 ms", "/health max ms",
             "others on server CPUs", "attack statuses", "met")]
    for name, s in report["phases"].items():
        kernel = s.get("server_profile", {}).get("kernel") or {}
        rows.append((name, str(s["victim_itl_p50_ms"]), str(s["victim_itl_p99_ms"]),
                     str(s.get("itl_p99_vs_baseline", "-")), str(s["health_p99_ms"]), str(s["health_max_ms"]),
                     str(kernel.get("others_on_those_cpus_cores", "-")),
                     json.dumps(s["attack_statuses"]), str(s.get("met", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
