"""`--workload steady`: base against adapter cases at fixed concurrency, measured in a steady window.

One trace (server.bench.workload: prompts and lengths from the seed, adapters from their own
stream) serves every case; the base case is that trace with no adapter, and the bench checks that
every case's trace has the same prompt and output token totals. Cases: base; each rank (16 first,
then 8, as asked) x adapter count x popularity (uniform, power law), one slot per adapter, every
adapter loaded by the warm-up before the window; and churn (more adapters than slots) only as its
own named case. Each case runs the in-process engine and, with --target http, a `loraplex serve`
beside it, at each concurrency: `concurrency` requests in flight, refilled from the trace as they
finish, for --warmup seconds, then the --steady-duration window, which alone is measured
(metrics.window_summary). Rounds (--repeats) run the cases again in alternating order; each row is
the median round with the rounds' spread, and the ratio to base is paired within rounds.

Beside each adapter row: the bandwidth bound (server.bench.bandwidth) for its rank and the
distinct adapters expected in a step, and at concurrency 1 the base model's weight-read floor.
With --peft-check N, the first N requests of each adapter case are checked on token ids against
transformers + peft (server.bench.token_check).
"""
from __future__ import annotations

import asyncio
import gc
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from server.bench import bandwidth
from server.bench.artifacts import save_figure, write_json
from server.bench.environment import environment, machine_state
from server.bench.metrics import ratio, window_summary
from server.bench.model_setup import (engine_kwargs, kv_cache_blocks, lora_slots, point_adapters, resolve_model,
                                      serve_args)
from server.bench.rounds import combine_rounds, round_order, spread
from server.bench.step_kinds import step_kinds
from server.bench.workload import BenchRequest, adapters_used, check_same_trace, generate_workload, trace_totals


@dataclass(frozen=True)
class Case:
    name: str
    num_adapters: int       # 0: the base model
    rank: int | None
    alpha: float            # popularity: 1 uniform, < 1 power law
    popularity: str         # uniform | power | distinct (round robin: request i -> adapter i mod n)
    slots: int
    churn: bool = False


def plan_cases(cfg) -> list[Case]:
    """cfg: a BenchConfig. Base first, then rank x adapters x popularity, then churn."""
    cases = [Case("base", 0, None, 1.0, "uniform", 1)]
    for rank in cfg.ranks:
        for n in dict.fromkeys(cfg.adapter_counts):
            if n == 0:
                continue
            for pop in cfg.popularity:
                alpha = cfg.power_alpha if pop == "power" else 1.0
                cases.append(Case(f"r{rank}-{n}-{pop}", n, rank, alpha, pop, lora_slots(cfg.max_loras, n)))
    if cfg.churn is not None:
        n, slots = cfg.churn
        cases.append(Case(f"churn-r{cfg.ranks[0]}-{n}-over-{slots}", n, cfg.ranks[0], 1.0, "uniform",
                          lora_slots(slots, n, churn=True), churn=True))
    return cases


def case_trace(cfg, case: Case, vocab: int) -> list[BenchRequest]:
    return generate_workload(replace(cfg.workload(case.num_adapters, vocab), alpha=case.alpha,
                                     round_robin=case.popularity == "distinct"))


def _measure(run, cfg, case: Case, concurrency: int, target: str, state: dict) -> dict:
    """One closed-loop run's result (run: metrics.ClosedLoopRun)."""
    window = window_summary(run.records, cfg.warmup_s, run.held_until_s)
    done = [r for r in run.records if r.ok]
    return {"case": case.name, "num_adapters": case.num_adapters, "rank": case.rank, "alpha": case.alpha,
            "popularity": case.popularity,
            "slots": case.slots, "churn": case.churn, "concurrency": concurrency, "target": target,
            "machine": state, "loraplex": window, "requests_sent": len(run.records), "completed": len(done),
            "short_outputs": sum(r.output_tokens < r.expected_tokens for r in done),
            "errors": sorted({r.error for r in run.records if r.error})[:5],
            "trace_exhausted": run.trace_exhausted, "window_short": window["window_s"] < cfg.steady_s,
            # The window's engine steps by kind (server.bench.step_kinds); None over HTTP, which cannot see them.
            "steps": step_kinds(run.steps, cfg.warmup_s, run.held_until_s) if target == "engine" else None}


def _engine_runs(cfg, model_dir: Path, case: Case, trace, named, log, check: int) -> tuple[list[dict], dict | None]:
    from server.bench.engine_target import EngineTarget

    target = EngineTarget(model_dir, named, **engine_kwargs(cfg, model_dir, case.slots, case.rank))
    target.warmup(trace)
    out = []
    for c in cfg.concurrency:
        state = machine_state(log)
        run = target.run_closed_loop(trace, c, cfg.warmup_s + cfg.steady_s)
        out.append(_measure(run, cfg, case, c, "engine", state))
    ids = None
    if check:
        subset = [replace(r, arrival_s=0.0) for r in trace[:check]]
        target.outputs.clear()
        target.run(subset)
        ids = dict(target.outputs)
    target.engine.shutdown()
    del target
    if cfg.device.startswith("cuda"):
        gc.collect()  # the next case's engine (or server) needs this one's memory back
        torch.cuda.empty_cache()
    return out, ids


def _http_runs(cfg, model_dir: Path, case: Case, trace, named, log) -> list[dict]:
    from server.bench import client
    from server.bench.server_proc import bench_server

    args = serve_args(cfg, case.num_adapters, kv_cache_blocks(cfg, model_dir), slots=case.slots, rank=case.rank)
    out = []
    with bench_server(cfg.work_dir, model_dir, args, trace, named, log) as (url, keys, base):
        for c in cfg.concurrency:
            state = machine_state(log)
            run = asyncio.run(client.drive_closed_loop(url, trace, keys, base, c, cfg.warmup_s + cfg.steady_s))
            out.append(_measure(run, cfg, case, c, "http", state))
    return out


def _peft_check(cfg, model_dir: Path, trace, named, ours: dict[int, list[int]]) -> dict:
    from server.bench.token_check import compare_token_ids, peft_token_ids

    subset = trace[:cfg.peft_check]
    theirs = peft_token_ids(model_dir, named, subset, device=cfg.device, dtype=cfg.dtype,
                            max_batch=cfg.baseline_max_batch, threads=cfg.threads())
    return compare_token_ids(subset, ours, theirs)


def _bounds(cfg, model_cfg: dict, row: dict, base_row: dict | None, bw: float | None) -> dict:
    """The bandwidth bound beside an adapter row, and the weight-read floor beside concurrency 1."""
    elt = bandwidth.DTYPE_BYTES[cfg.dtype]
    base_bytes = bandwidth.base_weight_bytes(model_cfg, elt)
    out: dict = {"base_weight_bytes": base_bytes, "bandwidth_gbps": bw}
    base_tok_s = base_row["loraplex"]["throughput_tok_s"] if base_row else None
    # In steady state every running sequence gets one token per step.
    base_step_s = row["concurrency"] / base_tok_s if base_tok_s else None
    if bw:
        floor = bandwidth.weight_read_floor_s(base_bytes, bw)
        out["weight_read_floor_ms"] = 1e3 * floor
        if row["concurrency"] == 1 and base_step_s:
            out["base_step_over_floor"] = base_step_s / floor
    if row["num_adapters"]:
        n, c = row["num_adapters"], row["concurrency"]
        expected = (min(n, c) if row.get("popularity") == "distinct"
                    else bandwidth.expected_distinct(n, c, row["alpha"]))
        distinct = min(expected, row["slots"])
        one = bandwidth.adapter_bytes(model_cfg, row["rank"], elt)
        b = bandwidth.bound(base_bytes, distinct * one, base_step_s, bw)
        out.update(adapter_bytes=one, distinct_per_step=distinct, **b)
        if row.get("ratio_vs_base") and b["time_bound"]:
            # Only against the measured base step: the bytes-only figure assumes a base step at its
            # HBM floor, and a slower one (the host, compute) pays relatively less for the same bytes.
            out["share_of_bound"] = row["ratio_vs_base"]["median"] / b["time_bound"]
    return out


def combine(cfg, rounds: dict[tuple[str, int, str], list[dict]], model_cfg: dict, bw: float | None) -> list[dict]:
    """Each (case, concurrency, target): its median round with the spread, the ratio to base paired
    within rounds, and the bounds."""
    rows = []
    for (name, c, target), runs in rounds.items():
        row = dict(combine_rounds(runs))
        speeds = [r["loraplex"]["throughput_tok_s"] for r in runs if r["loraplex"]["throughput_tok_s"] is not None]
        row.setdefault("loraplex_tok_s_spread", spread(speeds) if speeds else None)  # one round: set here
        base_runs = rounds.get(("base", c, target), [])
        if name != "base" and base_runs:
            ratios = [ratio(r["loraplex"]["throughput_tok_s"], b["loraplex"]["throughput_tok_s"])
                      for r, b in zip(runs, base_runs)]
            ratios = [x for x in ratios if x is not None]
            row["ratio_vs_base"] = spread(ratios) if ratios else None
        base_row = combine_rounds(base_runs) if base_runs else None
        row["bounds"] = _bounds(cfg, model_cfg, row, base_row, bw)
        rows.append(row)
    return rows


def run_steady_bench(cfg, json_path: Path | None = None, log: Callable[[str], None] = print) -> dict:
    model_dir, label = resolve_model(cfg, log)
    model_cfg = json.loads((model_dir / "config.json").read_text())
    vocab = model_cfg["vocab_size"]
    cfg_dict = asdict(cfg)
    cfg_dict.pop("extra")
    cfg_dict["model_label"] = cfg.model_label or label
    cfg_dict["rate"] = None if math.isinf(cfg.rate) else cfg.rate
    env = environment(cfg)
    bw = cfg.device_bandwidth_gbps or (bandwidth.device_bandwidth_gbps(env["device_name"])
                                       if cfg.device.startswith("cuda") else None)
    env["device_bandwidth_gbps"] = bw
    cases = plan_cases(cfg)
    targets = ("engine", "http") if cfg.target == "http" else ("engine",)
    traces = {c.name: case_trace(cfg, c, vocab) for c in cases}
    totals = [trace_totals(traces[c.name]) for c in cases]
    check_same_trace(totals)  # the base run is the same trace with no adapter
    doc = {"workload": "steady", "config": cfg_dict, "environment": env, "trace": totals[0],
           "cases": [asdict(c) for c in cases], "rows": [], "token_ids_vs_peft": {}}
    log(f"steady: {len(cases)} cases x concurrency {list(cfg.concurrency)} x {'/'.join(targets)} x "
        f"{cfg.repeats} rounds; {cfg.warmup_s:g} s warm-up + {cfg.steady_s:g} s window each; "
        f"trace {totals[0]['requests']} requests")
    rounds: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(cfg.repeats):
        for case in round_order(tuple(cases), r):
            trace = traces[case.name]
            named = point_adapters(cfg, model_dir, adapters_used(trace), rank=case.rank) if case.num_adapters else {}
            check = cfg.peft_check if r == 0 and case.num_adapters and not case.churn else 0
            t = time.perf_counter()
            runs, ids = _engine_runs(cfg, model_dir, case, trace, named, log, check)
            if "http" in targets:
                runs += _http_runs(cfg, model_dir, case, trace, named, log)
            for run in runs:
                rounds.setdefault((case.name, run["concurrency"], run["target"]), []).append(run)
                w = run["loraplex"]
                log(f"  round {r + 1} {case.name} c={run['concurrency']} {run['target']}: "
                    f"{w['throughput_tok_s'] or 0:.1f} tok/s over {w['window_s']:.1f} s"
                    + (" (trace ran out: window short, raise --requests)" if run["window_short"] else ""))
            if ids is not None:
                doc["token_ids_vs_peft"][case.name] = _peft_check(cfg, model_dir, trace, named, ids)
            log(f"  {case.name} done in {time.perf_counter() - t:.1f}s")
            doc["rows"] = combine(cfg, rounds, model_cfg, bw)
            if json_path is not None:
                write_json(doc, json_path)  # after every case, so a long sweep keeps what it has
    return doc


def _f(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _graphed(steps: dict | None) -> str:
    """'graphed/steps time%': e.g. 310/480 52% (the graphed steps took 52% of the steps' wall time)."""
    if not steps or not steps["steps"]:
        return "-"
    total = steps["graphed_s"] + steps["eager_s"]
    return f"{steps['graphed']}/{steps['steps']} {steps['graphed_s'] / total if total else 0:.0%}"


def format_steady_table(doc: dict) -> str:
    head = (f"{'case':<22} {'tgt':<6} {'conc':>4} {'tok/s':>9} {'spread':>7} {'x base':>7} {'bound':>6} "
            f"{'TTFT p50':>8} {'p90':>7} {'p99':>7} {'ITL p50':>7} {'p90':>6} {'p99':>6} {'win s':>6} "
            f"{'graphed':>15}   (ms)")
    c = doc["config"]
    lines = [f"steady state: {c['warmup_s']:g} s warm-up, then a {c['steady_s']:g} s window; each row the median "
             f"of {c['repeats']} round(s), spread = (max - min) / median of their tok/s; x base paired by round; "
             f"bound: with the base step at the device bandwidth, else bytes-only (a base step at its HBM floor); "
             f"graphed: the window's engine steps that replayed a decode CUDA graph / all, and their share of its "
             f"step time",
             head, "-" * len(head)]
    for row in doc["rows"]:
        w, sp, rb, b = row["loraplex"], row.get("loraplex_tok_s_spread"), row.get("ratio_vs_base"), row["bounds"]
        t, i = w["ttft_s"], w["itl_s"]
        lines.append(
            f"{row['case']:<22} {row['target']:<6} {row['concurrency']:>4} {_f(w['throughput_tok_s'], '.1f'):>9} "
            f"{_f(sp and sp['rel_range'], '.0%'):>7} {_f(rb and rb['median']):>7} {_f(b.get('bound')):>6} "
            f"{_f(t['p50'], '.0f', 1e3):>8} {_f(t['p90'], '.0f', 1e3):>7} {_f(t['p99'], '.0f', 1e3):>7} "
            f"{_f(i['p50'], '.1f', 1e3):>7} {_f(i['p90'], '.1f', 1e3):>6} {_f(i['p99'], '.1f', 1e3):>6} "
            f"{_f(w['window_s'], '.1f'):>6} {_graphed(row.get('steps')):>15}"
            + ("  SHORT WINDOW" if row.get("window_short") else ""))
        if row["num_adapters"]:
            lines.append(f"{'':<22} bound: {b['distinct_per_step']:.1f} distinct x {b['adapter_bytes'] / 1e6:.1f} MB "
                         f"= {b['extra_bytes'] / 1e6:.1f} MB/step beside {b['base_weight_bytes'] / 1e6:.1f} MB of base weights; "
                         f"bytes-only {b['bytes_bound']:.3f}"
                         + (f", with the base step {b['time_bound']:.3f}" if b.get("time_bound") else "")
                         + (f"; {b['share_of_bound']:.0%} of the bound" if b.get("share_of_bound") else ""))
        elif row["concurrency"] == 1 and b.get("weight_read_floor_ms"):
            lines.append(f"{'':<22} batch-1 floor: {b['weight_read_floor_ms']:.2f} ms/token at "
                         f"{b['bandwidth_gbps']:.0f} GB/s; base step x{_f(b.get('base_step_over_floor'))} the floor")
    for case, check in doc.get("token_ids_vs_peft", {}).items():
        lines.append(f"token ids = peft ({case}): {check['same']}/{check['compared']}"
                     + (f"; first mismatches {check['mismatches'][:3]}" if check["mismatches"] else ""))
    return "\n".join(lines)


def plot_steady(doc: dict, path: Path) -> None:
    """Decode tok/s per case (bars, one group per concurrency and target) with the rounds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["concurrency"], r["target"]) for r in doc["rows"]})
    cases = list(dict.fromkeys(r["case"] for r in doc["rows"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases) * len(groups)), 4.2))
    width = 0.8 / max(1, len(groups))
    for g, (c, target) in enumerate(groups):
        rows = {r["case"]: r for r in doc["rows"] if (r["concurrency"], r["target"]) == (c, target)}
        xs = [i + g * width for i, name in enumerate(cases) if name in rows]
        vals = [rows[name]["loraplex"]["throughput_tok_s"] or 0 for name in cases if name in rows]
        spreads = [rows[name].get("loraplex_tok_s_spread") for name in cases if name in rows]
        err = [[v - (s["min"] if s else v) for v, s in zip(vals, spreads)],
               [(s["max"] if s else v) - v for v, s in zip(vals, spreads)]]
        ax.bar(xs, vals, width, yerr=err, capsize=3, label=f"{target}, {c} in flight")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(cases, rotation=20, fontsize=8)
    ax.set_ylabel("output tokens / s in the window")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    env = doc.get("environment", {})
    ax.set_title(f"steady state: {doc['config'].get('model_label', '')} on {env.get('device_name', '?')}",
                 fontsize=10)
    save_figure(fig, path)
