"""The bench's outputs: a console table, the JSON document and a PNG plot."""
from __future__ import annotations

from pathlib import Path

from server.bench.artifacts import save_figure


def _f(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _row(n: int, system: str, s: dict) -> str:
    t, i = s["ttft_s"], s["itl_s"]
    return (f"{n:>8} {system:<9} {s['completed']:>4}/{s['requests']:<4} {_f(s['throughput_req_s']):>7} "
            f"{_f(s['throughput_tok_s'], '.1f'):>9} {_f(t['p50'], '.0f', 1e3):>8} {_f(t['p90'], '.0f', 1e3):>8} "
            f"{_f(t['p99'], '.0f', 1e3):>8} {_f(i['p50'], '.1f', 1e3):>7} {_f(i['p99'], '.1f', 1e3):>7} "
            f"{_f(s['slo_attainment'], '.0%', 1.0):>5}")


def _same(label: str, counts: dict | None) -> str:
    """"; label same/compared" for an output agreement (server.bench.metrics.agreement), or ""."""
    return f"; {label} {counts['same']}/{counts['compared']}" if counts else ""


def format_table(doc: dict, per_tenant: bool = False) -> str:
    if doc.get("workload") == "prefix":
        from server.bench.prefix import format_prefix_table

        return format_prefix_table(doc)
    if doc.get("workload") == "steady":
        from server.bench.steady import format_steady_table

        return format_steady_table(doc)
    if doc.get("workload") == "structured":
        from server.bench.structured import format_structured_table

        return format_structured_table(doc)
    head = (f"{'adapters':>8} {'system':<9} {'done':>9} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>8} "
            f"{'p90':>8} {'p99':>8} {'ITL p50':>7} {'p99':>7} {'SLO':>5}   (times in ms)")
    lines = [head, "-" * len(head)]
    repeats = doc.get("config", {}).get("repeats", 1)
    if repeats > 1:
        lines.append(f"each row: the median of {repeats} rounds (order alternating); ratios: medians of the "
                     f"rounds' paired ratios")
    for p in doc["points"]:
        lines.append(_row(p["num_adapters"], "loraplex", p["loraplex"]))
        if p.get("variants"):
            lines.append(f"{'':>8}   (loraplex: {p['variants'][0]['label']}, the reference)")
        for v in p.get("variants", [])[1:]:
            lines.append(_row(p["num_adapters"], "variant", v["loraplex"]))
            lines.append(f"{'':>8}   {v['label']}: out tok/s x{_f(p['variant_throughput_ratios'][v['label']])} "
                         f"vs {p['variants'][0]['label']}")
        if p.get("baseline"):
            lines.append(_row(p["num_adapters"], "peft", p["baseline"]))
            lines.append(f"{'':>8} ratio     throughput x{p['throughput_ratio_vs_peft']:.2f} (out tok/s), "
                         f"x{p['request_throughput_ratio_vs_peft']:.2f} (req/s); "
                         f"TTFT p50 peft/loraplex x{_f(p['ttft_p50_ratio_peft_over_loraplex'])}"
                         + _same("text = peft", p.get("outputs_vs_peft"))
                         + _same("token ids = peft", p.get("token_ids_vs_peft")))
        if p.get("peer"):
            peer = doc.get("peer", {}).get("name", "peer")
            lines.append(_row(p["num_adapters"], peer, p["peer"]))
            lines.append(f"{'':>8} ratio     loraplex/{peer} x{_f(p.get('throughput_ratio_vs_peer'))} (out tok/s); "
                         f"TTFT p50 {peer}/loraplex x{_f(p.get('ttft_p50_ratio_peer_over_loraplex'))}"
                         + _same("text = loraplex", p.get("outputs_vs_peer"))
                         + _same(f"{peer} text = peft", p.get("peer_outputs_vs_peft")))
        if per_tenant:
            for tenant, s in p["loraplex"]["per_tenant"].items():
                lines.append(f"{'':>8}   {tenant:<12} {s['completed']:>4}/{s['requests']:<4} "
                             f"{_f(s['throughput_tok_s'], '.1f'):>9} tok/s  TTFT p50 "
                             f"{_f(s['ttft_s']['p50'], '.0f', 1e3)} ms  p99 {_f(s['ttft_s']['p99'], '.0f', 1e3)} ms"
                             f"  SLO {_f(s['slo_attainment'], '.0%', 1.0)}")
    scaling = doc.get("throughput_vs_fewest_adapters")
    if scaling:
        fewest = min(p["num_adapters"] for p in doc["points"])
        lines.append(f"loraplex out tok/s vs {fewest} adapter(s): "
                     + ", ".join(f"{n}: x{r:.2f}" for n, r in scaling.items())
                     + (" (median of paired rounds)" if repeats > 1 else ""))
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Output tokens/s and TTFT (p50, p99) against the number of adapters."""
    if doc.get("workload") == "prefix":
        from server.bench.prefix import plot_prefix

        plot_prefix(doc, path)
        return
    if doc.get("workload") == "steady":
        from server.bench.steady import plot_steady

        plot_steady(doc, path)
        return
    if doc.get("workload") == "structured":
        from server.bench.structured import plot_structured

        plot_structured(doc, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(doc["points"], key=lambda p: p["num_adapters"])
    xs = [p["num_adapters"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    systems = [("loraplex", "loraplex", "tab:blue")]
    if any(p.get("baseline") for p in points):
        systems.append(("baseline", "transformers + peft", "tab:red"))
    if any(p.get("peer") for p in points):
        systems.append(("peer", doc.get("peer", {}).get("name", "peer"), "tab:green"))
    for key, label, color in systems:
        pts = [(p["num_adapters"], p[key]) for p in points if p.get(key)]
        ax1.plot([x for x, _ in pts], [s["throughput_tok_s"] for _, s in pts], "o-", color=color, label=label)
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [s["ttft_s"][q] for _, s in pts]
            ax2.plot([x for x, _ in pts], ys, style, color=color, label=f"{label} {q}")
    for ax, title, ylabel in ((ax1, "throughput", "output tokens / s"), (ax2, "time to first token", "seconds")):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("number of adapters")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    env = doc.get("environment", {})
    fig.suptitle(f"loraplex bench: {doc['config'].get('model_label', '')} on {env.get('device_name', '?')}, "
                 f"{doc['config']['num_requests']} requests per point", fontsize=10)
    save_figure(fig, path)
