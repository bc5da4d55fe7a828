"""The abuse benchmark (issue 22): a victim tenant streams while another tenant attacks.

Phases run in turn, each for `phase_s` seconds: a quiet baseline, then each attack. Throughout,
the victim streams greedy completions one after another and records every inter-token gap, and
a poller times GET /health. The attacks are the ones seen to stall everyone: a 16 MB token-array
body (from a tenant within its quota and from one over it), /tokenize and /detokenize floods,
logprob-heavy echo requests (the 200 MB response, and the largest one the output budget allows),
and n x max_tokens batches past the tenant's per-request cap; and issue 43's: grammars and regexes
nesting unbounded repetitions 40 deep, two tenants loading adapters from slow and dripping http
sources on loopback (benchmarks.security.slow_sources), and a tenant limited to 2 requests a minute
flooding distinct slow-to-compile constraints. Target: the victim's p99 ITL moves by at most 20%
against the baseline (30% under issue 43's attacks) and /health p99 stays at most 100 ms; under
slow_source the victim's cold load of a local-directory adapter takes at most 1 s; and where the
server bounds the attacker's requests (a compile's CPU deadline with its wall-clock cap, a fetch
deadline) each of them ends within that bound. Each phase reports the attacker's longest request;
the baseline, slow_source and compile_flood phases also the victim's one-off probes (a cold local
load, a new small schema).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.security.nested_constraints import nested_grammar, nested_regex
from benchmarks.security.schema_flood import slow_regex
from benchmarks.security.slow_sources import DRIP, SLOW, SlowSource
from benchmarks.security.victim_harness import VICTIM_TOKENS, LoopResult, Target, client, new_tenant, run_phases

ITL_TARGET_RATIO = 1.20
ISSUE43_ITL_TARGET_RATIO = 1.30
HEALTH_TARGET_S = 0.100
COLD_LOAD_TARGET_S = 1.0
BUDGET_SLACK_S = 1.0  # on top of the server's own bound: the request's way in and out, a busy machine
DRIP_FRACTION = 0.75  # a drip's interval against the fetch timeout: each read ends inside it

# A request body: fixed (encoded once: building it per request would load the attacker, not the
# server), or made per request by (loop number, request number, tag unique to the loop, the loop's
# slow source URL or None).
Body = bytes | Callable[[int, int, str, str | None], bytes]


@dataclass(frozen=True)
class Attack:
    tenants: tuple[str, ...]  # one request loop each: "open" (no limits), "limited" (1 request a minute),
    #                           "capped", "slow_a"/"slow_b" (no limits), "flooder" (2 requests a minute)
    path: str
    body: Body
    itl_ratio_target: float = ITL_TARGET_RATIO
    budget_s: float | None = None  # the longest one of its requests may take (None: the server sets no bound)
    slow_source: bool = False  # each loop serves adapter files from a SlowSource of its own


def _encode(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _slow_load(loop: int, i: int, tag: str, source: str | None) -> bytes:
    """A new adapter each time, from the loop's slow source (even loops) or its drip (odd ones)."""
    kind = (SLOW, DRIP)[loop % 2]
    return _encode({"lora_name": f"{kind}-{tag}-{i}", "lora_path": f"{source}/{kind}/{tag}-{i}/"})


def _slow_compile(model: str, loop: int, i: int, tag: str, source: str | None) -> bytes:
    """A constraint never seen before that takes longer to compile than any deadline allows."""
    return _encode({"model": model, "prompt": "x", "max_tokens": 4,
                    "structured_outputs": {"regex": slow_regex(f"{tag}{i:04d}")}})


def _attacks(target: Target) -> dict[str, Attack]:
    m, limit = target.model, target.max_model_len
    body = _encode
    huge = ('{"model":"%s","prompt":[%s],"max_tokens":1}' % (m, ",".join(["1234"] * 3_000_000))).encode()
    text = ("hello world " * limit)[:limit - 8]  # fits the context even at one token per character
    logprob_heavy = {"model": m, "prompt": [[5] * (limit - 2)] * 64, "max_tokens": 1, "echo": True,
                     "logprobs": 20, "prompt_logprobs": 20}
    # the largest echo the output budget lets through: prompts x (prompt tokens + 1) x 21 <= the budget
    fits = max(1, min(64, target.max_logprob_entries // ((limit - 1) * 21)))
    allowed = {**logprob_heavy, "prompt": [[5] * (limit - 2)] * fits, "prompt_logprobs": None}
    # here, not at the top: it imports torch and xgrammar, which the attack processes importing this module never need
    from server.engine.grammar_worker import WALL_CAP_FACTOR

    # The server's bound on one compile: its CPU deadline, or WALL_CAP_FACTOR times that in wall-clock
    # time for a compile process (niced below the engine) starved of CPU.
    compile_budget = WALL_CAP_FACTOR * target.compile_deadline_s + BUDGET_SLACK_S
    return {
        "huge_token_body": Attack(("open",), "/v1/completions", huge),
        "huge_body_over_quota": Attack(("limited",), "/v1/completions", huge),
        "tokenize_flood": Attack(("open",) * 4, "/tokenize", body({"model": m, "prompt": text})),
        "detokenize_flood": Attack(("open",) * 4, "/detokenize", body({"model": m, "tokens": [7] * limit})),
        "detokenize_2e20_ids": Attack(("open",) * 2, "/detokenize", body({"model": m, "tokens": [7] * (1 << 20)})),
        "logprob_echo_200mb": Attack(("open",), "/v1/completions", body(logprob_heavy)),
        "logprob_echo_in_budget": Attack(("open",), "/v1/completions", body(allowed)),
        "n_x_max_tokens": Attack(("capped",) * 2, "/v1/completions", body({
            "model": m, "prompt": ["hello"] * 64, "n": 16, "max_tokens": 10, "ignore_eos": True})),
        # Issue 43: masks that grow costlier with every token (refused at compile now).
        "nested_grammar": Attack(("open",) * 2, "/v1/completions", body({
            "model": m, "prompt": "hi", "max_tokens": 40, "min_tokens": 40, "guided_grammar": nested_grammar(40)}),
            ISSUE43_ITL_TARGET_RATIO, compile_budget),
        "nested_regex": Attack(("open",) * 2, "/v1/completions", body({
            "model": m, "prompt": "hi", "max_tokens": 40, "min_tokens": 40, "guided_regex": nested_regex(40)}),
            ISSUE43_ITL_TARGET_RATIO, compile_budget),
        # Two tenants, each holding one of its loader slots with a fetch that never ends by itself: ended
        # at the server's fetch deadline (a tenant's one loop never queues behind its own fetches).
        "slow_source": Attack(("slow_a", "slow_b"), "/v1/load_lora_adapter", _slow_load,
                              ISSUE43_ITL_TARGET_RATIO, target.fetch_timeout_s + BUDGET_SLACK_S, slow_source=True),
        # The flooder's compiles share its one compile process: its second waits for its first.
        "compile_flood": Attack(("flooder",) * 2, "/v1/completions", functools.partial(_slow_compile, m),
                                ISSUE43_ITL_TARGET_RATIO, 2 * compile_budget),
    }


def _attack_loop(url: str, key: str, path: str, body: Body, phase_s: float, loop: int,
                 drip_s: float | None) -> LoopResult:
    """One attacker loop (in its own process, so its client work never delays the victim's clock);
    with `drip_s`, its adapter files come from a SlowSource of its own."""
    result = LoopResult()
    deadline = time.monotonic() + phase_s
    tag = f"{os.getpid()}-{loop}"
    with contextlib.ExitStack() as stack:
        source = None if drip_s is None else stack.enter_context(SlowSource(drip_s)).url
        c = stack.enter_context(httpx.Client(base_url=url, timeout=300, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}))
        i = 0
        while time.monotonic() < deadline:
            i += 1
            content = body if isinstance(body, bytes) else body(loop, i, tag, source)
            start = time.monotonic()
            try:
                result.statuses[str(c.post(path, content=content).status_code)] += 1
            except httpx.HTTPError as e:
                result.statuses[type(e).__name__] += 1
            result.longest_s = max(result.longest_s, time.monotonic() - start)
    return result


def _victim_probes(target: Target, key: str, cold_adapters: list[str]) -> Callable[[str], dict]:
    """The victim's one-off requests in a phase: a cold load of each local-directory adapter it is
    given (the first in the baseline, the rest under slow_source) and one new small schema (in the
    baseline and under compile_flood)."""
    def probe(phase: str) -> dict:
        out: dict = {}
        cold = {"baseline": cold_adapters[:1], "slow_source": cold_adapters[1:]}.get(phase, [])
        if cold:
            loads = [_timed(target, key, "/v1/load_lora_adapter", {"lora_name": f"{phase}-{path}", "lora_path": path})
                     for path in cold]
            out["cold_local_load_s"] = [s for s, _ in loads]
            out["cold_local_load_statuses"] = [status for _, status in loads]
        if phase in ("baseline", "compile_flood"):
            schema = {"type": "object", "properties": {f"{phase}_{time.time_ns()}": {"type": "integer"}}}
            out["new_schema_s"], out["new_schema_status"] = _timed(target, key, "/v1/completions", {
                "model": target.model, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}})
        return out
    return probe


def _timed(target: Target, key: str, path: str, body: dict) -> tuple[float, int]:
    """(seconds, status) of one request."""
    with client(target, key) as c:
        start = time.perf_counter()
        status = c.post(path, json=body).status_code
        return round(time.perf_counter() - start, 3), status


def run(target: Target, phase_s: float = 10.0, only: list[str] | None = None,
        log: Callable[[str], None] = lambda s: None, attacker_cpus: tuple[int, ...] | None = None,
        profile: tuple[int, Path] | None = None, cold_adapters: list[str] | None = None,
        attacker_nice: int = 0, trace: Path | None = None) -> dict:
    """Run the baseline and each attack (or those named in `only`); returns the JSON report. The
    attacker's processes run on `attacker_cpus` (None: wherever the OS puts them). `cold_adapters`:
    local-directory adapter paths the server can load (--adapter-sources local), each a new one,
    for the victim's cold loads (the first in the baseline, the rest under slow_source; none: no
    cold loads). slow_source needs the server to allow http sources on loopback. `trace`: run_phases'."""
    tag = str(int(time.time() * 1000))[-8:]
    keys = {"victim": new_tenant(target, f"victim-{tag}", {}),
            "open": new_tenant(target, f"open-{tag}", {}),
            "limited": new_tenant(target, f"limited-{tag}", {"requests_per_minute": 1}),
            "capped": new_tenant(target, f"capped-{tag}", {"max_tokens_per_request": 10}),
            "slow_a": new_tenant(target, f"slow-a-{tag}", {}),
            "slow_b": new_tenant(target, f"slow-b-{tag}", {}),
            "flooder": new_tenant(target, f"flooder-{tag}", {"requests_per_minute": 2})}
    attacks = _attacks(target)

    def start(name: str, pool: ProcessPoolExecutor) -> list[Future]:
        attack = attacks[name]
        if "limited" in attack.tenants:
            # Spend its one request a minute: refused requests never count, so only a tenant
            # that used its quota is over it (and then its bodies are refused unread).
            with client(target, keys["limited"]) as c:
                c.post("/v1/completions", json={"model": target.model, "prompt": "hi", "max_tokens": 1})
        drip_s = target.fetch_timeout_s * DRIP_FRACTION if attack.slow_source else None
        return [pool.submit(_attack_loop, target.url, keys[tenant], attack.path, attack.body, phase_s, loop, drip_s)
                for loop, tenant in enumerate(attack.tenants)]

    names = [n for n in attacks if only is None or n in only]
    phases = run_phases(target, keys["victim"], names, phase_s, max(len(a.tenants) for a in attacks.values()),
                        start, attacker_cpus, log, profile, _victim_probes(target, keys["victim"], cold_adapters or []),
                        attacker_nice, trace)
    baseline = phases[0]
    summaries = {}
    for p in phases:
        s = p.summary(None if p is baseline else baseline)
        if p is not baseline:
            _judge(s, attacks[p.name])
        summaries[p.name] = s
    return {"phase_s": phase_s, "victim_tokens_per_request": VICTIM_TOKENS,
            "targets": {"itl_p99_ratio": ITL_TARGET_RATIO, "issue43_itl_p99_ratio": ISSUE43_ITL_TARGET_RATIO,
                        "health_p99_ms": HEALTH_TARGET_S * 1000, "cold_local_load_s": COLD_LOAD_TARGET_S},
            "server_bounds": {"fetch_timeout_s": target.fetch_timeout_s,
                              "compile_deadline_s": target.compile_deadline_s},
            "phases": summaries, "met": all(s.get("met", True) for s in summaries.values())}


def _judge(s: dict, attack: Attack) -> None:
    """Adds a phase summary's verdicts: the attacker's budget, and `met` (every target of the phase)."""
    s["itl_p99_ratio_target"] = attack.itl_ratio_target
    s["attacker_budget_s"] = attack.budget_s
    longest = s["attacker_longest_s"]
    s["attacker_within_budget"] = None if attack.budget_s is None or longest is None else longest <= attack.budget_s
    probes = s.get("victim_probes", {})
    loads_met = (all(t <= COLD_LOAD_TARGET_S for t in probes.get("cold_local_load_s", []))
                 and all(status == 200 for status in probes.get("cold_local_load_statuses", [])))
    s["met"] = (s["itl_p99_vs_baseline"] is not None and s["itl_p99_vs_baseline"] <= attack.itl_ratio_target
                and s["health_p99_ms"] is not None and s["health_p99_ms"] <= HEALTH_TARGET_S * 1000
                and loads_met and s["attacker_within_budget"] is not False)


def table(report: dict) -> str:
    # with --profile: what other processes took of the server's CPUs (the noise no attack explains)
    rows = [("phase", "ITL p50 ms", "ITL p99 ms", "p99 vs base", "/health p99 ms", "/health max ms",
             "others on server CPUs", "attack statuses", "attacker longest s (budget)", "victim probes s", "met")]
    for name, s in report["phases"].items():
        kernel = s.get("server_profile", {}).get("kernel") or {}
        rows.append((name, str(s["victim_itl_p50_ms"]), str(s["victim_itl_p99_ms"]),
                     str(s.get("itl_p99_vs_baseline", "-")), str(s["health_p99_ms"]), str(s["health_max_ms"]),
                     str(kernel.get("others_on_those_cpus_cores", "-")),
                     json.dumps(s["attack_statuses"]), _attacker_outcome(s), _probes(s.get("victim_probes", {})),
                     str(s.get("met", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def _attacker_outcome(s: dict) -> str:
    """"4.03 (5.0: yes)": the attacker's longest request and its budget, met or not ("-": no attacker)."""
    if s["attacker_longest_s"] is None:
        return "-"
    budget = s.get("attacker_budget_s")
    verdict = "" if budget is None else f" ({budget}: {'yes' if s['attacker_within_budget'] else 'no'})"
    return f"{s['attacker_longest_s']}{verdict}"


def _probes(p: dict) -> str:
    parts = []
    if "cold_local_load_s" in p:
        parts.append("cold load " + ",".join(str(t) for t in p["cold_local_load_s"]))
    if "new_schema_s" in p:
        parts.append(f"new schema {p['new_schema_s']}")
    return "; ".join(parts) or "-"
