"""`--workload structured` (issue 24): the schema suite (server.bench.schema_suite) through a
`loraplex serve` child, adapters and the base model mixed, in two parts.

validity: one request per schema of the suite (OpenAI `response_format` json_schema, every fourth
  as vLLM's `structured_outputs`), `--concurrency` at a time, sampled (temperature 1, seeded). The
  share of completed outputs (`finish_reason: stop`) that jsonschema accepts, formats checked, is
  the headline (target 100%); outputs cut off at max_tokens are counted apart.
throughput: `--concurrency` requests at once (target: 32), unconstrained, then the same with half
  of them constrained, rounds alternating the order (`--repeats`). Every request runs to its
  `--output-len` maximum (ignore_eos; a constrained one gets its suite schema as the item of an
  array at least twice that many items long, which cannot close sooner), so both runs make the
  same number of tokens and their ratio of output tok/s is the cost of the constraints
  (target: at most 10% loss). The array schemas are compiled in a warm-up round, so the ratio is
  the masks' cost, not the compiles'.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import httpx

from server.bench.environment import environment, machine_state
from server.bench.metrics import ratio
from server.bench.model_setup import point_adapters, resolve_model, serve_args
from server.bench.schema_suite import load_suite
from server.bench.workload import BenchRequest, adapters_used, generate_workload

VALIDITY_MAX_TOKENS = 512  # room for the suite's largest schemas; a longer output counts as "length"
VALID_TARGET = 1.0
THROUGHPUT_LOSS_TARGET = 0.10


@dataclass
class Outcome:
    """One validity request."""
    schema: str
    model: str
    finish_reason: str | None = None
    valid: bool | None = None       # for finish_reason "stop": whether jsonschema accepted it
    why: str | None = None          # the validation error, or the HTTP error
    json_valid: bool | None = None  # for finish_reason "stop": whether the text parsed as JSON
    tail: str | None = None         # for finish_reason "length": the output's last characters


def _schema_field(index: int, name: str, schema: dict) -> dict:
    if index % 4 == 3:
        return {"structured_outputs": {"json": schema}}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": name.replace("/", "-"), "schema": schema, "strict": True}}}


def _long_array(schema: dict, items: int) -> dict:
    """An array of at least `items` of `schema` (its $defs lifted to the root, where its refs point)."""
    item = {k: v for k, v in schema.items() if k != "$defs"}
    out = {"type": "array", "items": item, "minItems": items}
    if "$defs" in schema:
        out["$defs"] = schema["$defs"]
    return out


async def _post(client: httpx.AsyncClient, key: str, body: dict) -> dict:
    r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()


async def _validity(url: str, keys: dict[str, str], base: str, reqs: list[BenchRequest],
                    suite: list[tuple[str, dict]], concurrency: int, temperature: float = 1.0,
                    seed_offset: int = 0) -> list[Outcome]:
    import jsonschema

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    gate = asyncio.Semaphore(concurrency)
    outcomes = [Outcome(name, r.adapter_name or base) for r, (name, _) in zip(reqs, suite)]

    async def one(i: int, client: httpx.AsyncClient) -> None:
        r, (name, schema), out = reqs[i], suite[i], outcomes[i]
        body = {"model": out.model, "prompt": list(r.prompt_ids), "max_tokens": VALIDITY_MAX_TOKENS,
                "temperature": temperature, "seed": seed_offset + i, **_schema_field(i, name, schema)}
        async with gate:
            try:
                choice = (await _post(client, keys[r.tenant], body))["choices"][0]
            except (RuntimeError, httpx.HTTPError) as e:
                out.why = str(e)[:300]
                return
        out.finish_reason = choice["finish_reason"]
        if out.finish_reason == "length":
            out.tail = choice["text"][-160:]
        if out.finish_reason == "stop":
            try:
                value = json.loads(choice["text"])
                out.json_valid = True
                jsonschema.validate(value, schema, format_checker=checker)
                out.valid = True
            except (ValueError, jsonschema.ValidationError) as e:
                out.json_valid = bool(out.json_valid)
                out.valid, out.why = False, f"{str(e)[:200]} in {choice['text'][:200]!r}"

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        await asyncio.gather(*(one(i, client) for i in range(len(outcomes))))
    return outcomes


async def _burst(url: str, keys: dict[str, str], base: str, reqs: list[BenchRequest],
                 schemas: list[dict | None], max_tokens: int, cpu: Callable[[], float]) -> dict:
    """All of `reqs` at once, request i constrained by schemas[i] (None: unconstrained); cpu() is the
    server's CPU seconds so far."""
    async def one(i: int, client: httpx.AsyncClient) -> int:
        r = reqs[i]
        body = {"model": r.adapter_name or base, "prompt": list(r.prompt_ids), "max_tokens": max_tokens,
                "temperature": 0.8, "seed": i, "ignore_eos": True}
        if schemas[i] is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
        try:
            return (await _post(client, keys[r.tenant], body))["usage"]["completion_tokens"]
        except (RuntimeError, httpx.HTTPError) as e:  # counted, not fatal: a loaded machine refuses some
            errors.append(str(e)[:200])
            return 0

    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=len(reqs) + 4)) as c:
        start, cpu_start = time.perf_counter(), cpu()
        tokens = await asyncio.gather(*(one(i, c) for i in range(len(reqs))))
        seconds, cpu_seconds = time.perf_counter() - start, cpu() - cpu_start
    return {"tokens": sum(tokens), "seconds": seconds, "tok_s": sum(tokens) / seconds, "server_cpu_s": cpu_seconds,
            "tok_per_server_cpu_s": sum(tokens) / cpu_seconds, "errors": errors, "load_avg": os.getloadavg()}


def _validity_summary(outcomes: list[Outcome]) -> dict:
    stopped = [o for o in outcomes if o.finish_reason == "stop"]
    valid = [o for o in stopped if o.valid]
    by_model: dict[str, dict] = {}
    for o in outcomes:
        m = by_model.setdefault(o.model, {"requests": 0, "stop": 0, "valid": 0})
        m["requests"] += 1
        m["stop"] += o.finish_reason == "stop"
        m["valid"] += bool(o.valid)
    return {"schemas": len(outcomes), "stop": len(stopped), "valid_json": sum(bool(o.json_valid) for o in stopped),
            "valid": len(valid),
            "valid_share_of_stop": len(valid) / len(stopped) if stopped else None,
            "length": sum(o.finish_reason == "length" for o in outcomes),
            "errors": sum(o.finish_reason is None for o in outcomes),
            "met": bool(stopped) and len(valid) == len(stopped),
            "by_model": by_model,
            "invalid": [asdict(o) for o in stopped if not o.valid][:20],
            "failed": [asdict(o) for o in outcomes if o.finish_reason is None][:20]}


def run_structured_bench(cfg, json_path: Path | None = None, log: Callable[[str], None] = print) -> dict:
    """cfg: a BenchConfig with workload_type "structured" (its first adapter count and concurrency)."""
    from server.bench.artifacts import write_json
    from server.bench.server_proc import bench_server

    model_dir, label = resolve_model(cfg, log)
    suite = load_suite()[:cfg.num_requests]
    concurrency, max_tokens, n = cfg.concurrency[0], cfg.output_len[1], cfg.adapter_counts[0]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = generate_workload(replace(cfg.workload(n, vocab), num_requests=max(len(suite), concurrency),
                                     duration_s=None, rate=math.inf))
    used = adapters_used(reqs)
    named = point_adapters(cfg, model_dir, used)
    cfg_dict = asdict(cfg)
    cfg_dict.pop("extra")
    cfg_dict["model_label"] = cfg.model_label or label
    cfg_dict["rate"] = None
    doc = {"workload": "structured", "config": cfg_dict, "environment": environment(cfg),
           "targets": {"valid_share_of_stop": VALID_TARGET, "throughput_loss": THROUGHPUT_LOSS_TARGET}}
    burst = reqs[:concurrency]
    plain = [None] * concurrency
    half = [_long_array(suite[i][1], 2 * max_tokens) if i % 2 == 0 else None for i in range(concurrency)]
    server = []
    with bench_server(cfg.work_dir, model_dir, serve_args(cfg, len(used)), reqs, named, log,
                      on_start=server.append) as (url, keys, base):
        cpu = server[0].cpu_seconds
        doc["machine_before"] = machine_state(log)
        log(f"validity: {len(suite)} schemas, {concurrency} at a time, {len(used)} adapters and the base model")
        t = time.perf_counter()
        outcomes = asyncio.run(_validity(url, keys, base, reqs[:len(suite)], suite, concurrency))
        doc["validity"] = _validity_summary(outcomes)
        doc["validity"]["seconds"] = time.perf_counter() - t
        if json_path is not None:
            write_json(doc, json_path)
        log(f"throughput: {concurrency} requests x {max_tokens} tokens, half constrained vs none, "
            f"{cfg.repeats} round(s) after a warm-up")
        asyncio.run(_burst(url, keys, base, burst, half, 4, cpu))  # compiles the array schemas
        rounds: dict[str, list[dict]] = {"unconstrained": [], "half_constrained": []}
        for r in range(cfg.repeats):
            order = [("unconstrained", plain), ("half_constrained", half)]
            for name, schemas in (order if r % 2 == 0 else order[::-1]):
                rounds[name].append(asyncio.run(_burst(url, keys, base, burst, schemas, max_tokens, cpu)))
                last = rounds[name][-1]
                log(f"  round {r + 1} {name}: {last['tok_s']:.1f} tok/s, {last['tok_per_server_cpu_s']:.1f} "
                    f"tok per server CPU-s")
    def paired(key: str) -> list[float]:
        """Each round's half constrained / unconstrained ratio (the two arms ran back to back)."""
        return [ratio(c[key], u[key]) for c, u in zip(rounds["half_constrained"], rounds["unconstrained"])]

    ratios, ratios_cpu = paired("tok_s"), paired("tok_per_server_cpu_s")
    med, med_cpu = statistics.median(ratios), statistics.median(ratios_cpu)
    # Wall-clock tok/s moves with whatever else runs on the machine; tokens per CPU-second of the
    # server much less. The target is judged on both (each as the median of paired rounds).
    doc["throughput"] = {"concurrency": concurrency, "max_tokens": max_tokens, "rounds": rounds,
                         "median_tok_s": {k: statistics.median(x["tok_s"] for x in v) for k, v in rounds.items()},
                         "median_tok_per_server_cpu_s": {k: statistics.median(x["tok_per_server_cpu_s"] for x in v)
                                                         for k, v in rounds.items()},
                         "ratio_half_constrained": med, "loss": 1 - med,
                         "ratio_half_constrained_cpu": med_cpu, "loss_cpu": 1 - med_cpu,
                         "paired_ratios": ratios, "paired_ratios_cpu": ratios_cpu,
                         "met": max(1 - med, 1 - med_cpu) <= THROUGHPUT_LOSS_TARGET}
    doc["load_avg_after"] = os.getloadavg()
    if json_path is not None:
        write_json(doc, json_path)
    return doc


def format_structured_table(doc: dict) -> str:
    v, t = doc["validity"], doc["throughput"]
    share = v["valid_share_of_stop"]
    lines = [f"{'validity':<18} {'schemas':>7} {'stop':>5} {'valid':>5} {'valid/stop':>10} {'length':>6} "
             f"{'errors':>6}  met",
             f"{'all':<18} {v['schemas']:>7} {v['stop']:>5} {v['valid']:>5} "
             f"{'-' if share is None else format(share, '.1%'):>10} {v['length']:>6} {v['errors']:>6}  {v['met']}"]
    for model, m in sorted(v["by_model"].items()):
        lines.append(f"  {model:<16} {m['requests']:>7} {m['stop']:>5} {m['valid']:>5}")
    lines.append("")
    lines.append(f"{'throughput':<18} {'tok/s':>8} {'tok/cpu-s':>9}  rounds (tok/s)   [{t['concurrency']} "
                 f"requests x {t['max_tokens']} tokens; cpu-s: the server process's]")
    for name, rs in t["rounds"].items():
        lines.append(f"{name:<18} {t['median_tok_s'][name]:>8.1f} {t['median_tok_per_server_cpu_s'][name]:>9.1f}  "
                     + ", ".join(f"{x['tok_s']:.1f}" for x in rs))
    lines.append(f"half constrained / unconstrained (median of paired rounds): wall {t['ratio_half_constrained']:.3f} "
                 f"(loss {t['loss']:.1%}), server CPU {t['ratio_half_constrained_cpu']:.3f} (loss {t['loss_cpu']:.1%}); "
                 f"target loss <= {doc['targets']['throughput_loss']:.0%}: {'met' if t['met'] else 'missed'}")
    if "paired_ratios" in t:
        lines.append("paired ratios per round: wall " + ", ".join(f"{x:.3f}" for x in t["paired_ratios"])
                     + "; server CPU " + ", ".join(f"{x:.3f}" for x in t["paired_ratios_cpu"]))
    return "\n".join(lines)


def plot_structured(doc: dict, path: Path) -> None:
    """Output tok/s per round, unconstrained and half constrained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from server.bench.artifacts import save_figure

    t = doc["throughput"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for offset, (name, color) in ((-0.2, ("unconstrained", "tab:blue")), (0.2, ("half_constrained", "tab:orange"))):
        rs = t["rounds"][name]
        ax.bar([i + offset for i in range(len(rs))], [x["tok_s"] for x in rs], 0.4, color=color, label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{t['concurrency']} requests x {t['max_tokens']} tokens; ratio {t['ratio_half_constrained']:.3f}; "
                 f"valid {doc['validity']['valid']}/{doc['validity']['stop']}", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)
