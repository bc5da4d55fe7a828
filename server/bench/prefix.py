"""`--workload prefix`: chat traffic that repeats itself, through the in-process engine twice on the
same seeded trace, prefix cache off then on (server.bench.workload.generate_conversations).

Each point reports both runs' usual summary (TTFT, throughput), TTFT p50 per turn, the cache's hit
rate (cached / looked-up prompt tokens, from the engine's counters), the ratios off/on, and whether
every request's output tokens were the same both ways (greedy, so they must be).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from server.bench.artifacts import save_figure, write_json
from server.bench.environment import environment
from server.bench.metrics import percentile, ratio, summarize
from server.bench.model_setup import lora_slots, point_adapters, resolve_model
from server.bench.workload import adapters_used, generate_conversations

CACHE_RUNS = (("cache_off", False), ("cache_on", True))


def _engine_kwargs(cfg, n_used: int) -> dict:
    return dict(device=cfg.device, dtype=cfg.dtype, max_loras=lora_slots(cfg.max_loras, n_used),
                max_lora_rank=cfg.rank, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens, cpu_threads=cfg.threads(),
                enforce_eager=cfg.enforce_eager)


def _run_once(cfg, model_dir: Path, reqs, named: dict[str, Path], cache: bool) -> tuple[dict, dict[int, list[int]]]:
    from server.bench.engine_target import EngineTarget

    longest = max(len(r.prompt_ids) + r.max_tokens for r in reqs)
    target = EngineTarget(model_dir, named, prefix_caching=cache, max_model_len=longest,
                          **_engine_kwargs(cfg, len(named)))
    target.warmup(reqs)  # 4-token prompts: nothing cacheable, so the measured run starts cold
    before, load = target.engine.stats(), os.getloadavg()
    records = target.run(reqs)
    after = target.engine.stats()
    summary = summarize(records, cfg.ttft_slo_s)
    # A busy machine skews whichever run it was busy for: the load average says so.
    summary["load_avg"] = {"before": load, "after": os.getloadavg()}
    turns = sorted({r.turn for r in reqs})
    summary["ttft_p50_by_turn_s"] = {
        str(t): percentile([rec.ttft_s for r, rec in zip(reqs, records) if r.turn == t and rec.ok], 50)
        for t in turns}
    queries = after.prefix_cache.queried_tokens - before.prefix_cache.queried_tokens
    hits = after.prefix_cache.hit_tokens - before.prefix_cache.hit_tokens
    summary["prefix_cache"] = {"enabled": after.prefix_cache.enabled, "queries_tokens": queries,
                               "hit_tokens": hits, "hit_rate": hits / queries if queries else 0.0,
                               "cached_free_blocks_at_end": after.prefix_cache.cached_free_blocks}
    outputs = target.outputs
    target.engine.shutdown()
    del target
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return summary, outputs


def run_prefix_point(cfg, model_dir: Path, n: int, log: Callable[[str], None]) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = generate_conversations(cfg.workload(n, vocab))
    used = adapters_used(reqs)
    named = point_adapters(cfg, model_dir, used)
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    log(f"[{n} adapters] {len(reqs)} turns over {len(used)} adapters in use, {prompt_tokens} prompt tokens, "
        f"{sum(r.max_tokens for r in reqs)} output tokens")
    point = {"num_adapters": n, "adapters_in_use": len(used), "target": "engine", "requests": len(reqs),
             "prompt_tokens": prompt_tokens}
    outputs = {}
    for key, cache in CACHE_RUNS:
        t = time.perf_counter()
        point[key], outputs[key] = _run_once(cfg, model_dir, reqs, named, cache)
        log(f"  prefix cache {'on' if cache else 'off'}: done in {time.perf_counter() - t:.1f}s")
    off, on = point["cache_off"], point["cache_on"]
    point["ttft_p50_ratio_off_over_on"] = ratio(off["ttft_s"]["p50"], on["ttft_s"]["p50"])
    point["ttft_p90_ratio_off_over_on"] = ratio(off["ttft_s"]["p90"], on["ttft_s"]["p90"])
    point["throughput_ratio_on_over_off"] = ratio(on["throughput_tok_s"], off["throughput_tok_s"])
    point["request_throughput_ratio_on_over_off"] = ratio(on["throughput_req_s"], off["throughput_req_s"])
    point["hit_rate"] = on["prefix_cache"]["hit_rate"]
    same = [i for i in outputs["cache_off"] if outputs["cache_on"].get(i) == outputs["cache_off"][i]]
    point["outputs_identical"] = len(same) == len(reqs) == len(outputs["cache_on"])
    point["identical_outputs"] = len(same)
    return point


def run_prefix_bench(cfg, json_path: Path | None = None, log: Callable[[str], None] = print) -> dict:
    model_dir, label = resolve_model(cfg, log)
    cfg_dict = asdict(cfg)
    cfg_dict.pop("extra")
    cfg_dict["model_label"] = cfg.model_label or label
    cfg_dict["rate"] = None if math.isinf(cfg.rate) else cfg.rate  # JSON has no infinity
    doc = {"workload": "prefix", "config": cfg_dict, "environment": environment(cfg), "points": []}
    for n in cfg.adapter_counts:
        doc["points"].append(run_prefix_point(cfg, model_dir, n, log))
        if json_path is not None:
            write_json(doc, json_path)  # after every point, so a long sweep keeps what it has
    return doc


def _f(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def format_prefix_table(doc: dict) -> str:
    head = (f"{'adapters':>8} {'cache':<5} {'done':>9} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>8} {'p90':>8} "
            f"{'p99':>8} {'turn0 p50':>9} {'later p50':>9} {'hit rate':>8}   (times in ms)")
    lines = [head, "-" * len(head)]
    for p in doc["points"]:
        for key, label in (("cache_off", "off"), ("cache_on", "on")):
            s = p[key]
            t, by_turn = s["ttft_s"], s["ttft_p50_by_turn_s"]
            later = [v for k, v in by_turn.items() if k != "0" and v is not None]
            lines.append(f"{p['num_adapters']:>8} {label:<5} {s['completed']:>4}/{s['requests']:<4} "
                         f"{_f(s['throughput_req_s']):>7} {_f(s['throughput_tok_s'], '.1f'):>9} "
                         f"{_f(t['p50'], '.0f', 1e3):>8} {_f(t['p90'], '.0f', 1e3):>8} {_f(t['p99'], '.0f', 1e3):>8} "
                         f"{_f(by_turn.get('0'), '.0f', 1e3):>9} "
                         f"{_f(max(later) if later else None, '.0f', 1e3):>9} "
                         f"{_f(s['prefix_cache']['hit_rate'], '.0%'):>8}")
        lines.append(f"{'':>8} ratio TTFT off/on x{_f(p['ttft_p50_ratio_off_over_on'])} (p50), "
                     f"x{_f(p['ttft_p90_ratio_off_over_on'])} (p90); throughput on/off "
                     f"x{_f(p['throughput_ratio_on_over_off'])} (out tok/s), "
                     f"x{_f(p['request_throughput_ratio_on_over_off'])} (req/s); "
                     f"outputs identical {p['identical_outputs']}/{p['requests']}")
    return "\n".join(lines)


def plot_prefix(doc: dict, path: Path) -> None:
    """TTFT p50/p90 and output tokens/s, cache off and on, per adapter count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(doc["points"], key=lambda p: p["num_adapters"])
    xs = range(len(points))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for offset, (key, label, color) in ((-0.2, ("cache_off", "cache off", "tab:red")),
                                        (0.2, ("cache_on", "cache on", "tab:blue"))):
        ax1.bar([x + offset for x in xs], [p[key]["ttft_s"]["p50"] or 0 for p in points], 0.4, color=color,
                label=f"{label} p50")
        ax1.plot([x + offset for x in xs], [p[key]["ttft_s"]["p90"] or 0 for p in points], "k_", markersize=14)
        ax2.bar([x + offset for x in xs], [p[key]["throughput_tok_s"] for p in points], 0.4, color=color,
                label=label)
    for ax, title, ylabel in ((ax1, "time to first token (bar p50, tick p90)", "seconds"),
                              (ax2, "throughput", "output tokens / s")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(p["num_adapters"]) for p in points])
        ax.set_xlabel("number of adapters")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    c = doc["config"]
    fig.suptitle(f"prefix cache: {c.get('model_label', '')}, {c['shared_prefix_len']}-token system prompts, "
                 f"{c['turns']} turns", fontsize=10)
    save_figure(fig, path)
