"""A sweep run several times (`--repeats`): each point's median round, and ratios paired by round.

On a shared machine the same run moves by 10-30% from one minute to the next, more than the
differences a sweep is after (adapter count, another server). Rounds run the whole sweep again,
the order of points alternating (1, 8, 32 then 32, 8, 1) so no point always runs first; a ratio
between two runs is taken within each round, where the machine was alike for both, and the
median of those is reported.
"""
from __future__ import annotations

import statistics

from server.bench.variants import median_ratios

# Per-point ratios of two systems run one after the other on the same point: medians over rounds.
PAIRED_RATIOS = ("throughput_ratio_vs_peft", "request_throughput_ratio_vs_peft",
                 "ttft_p50_ratio_peft_over_loraplex", "throughput_ratio_vs_peer", "ttft_p50_ratio_peer_over_loraplex")
SYSTEMS = ("loraplex", "baseline", "peer")


def round_order(counts: tuple[int, ...], round_index: int) -> tuple[int, ...]:
    """The sweep's points in the given round: as given in even rounds, reversed in odd ones."""
    return counts if round_index % 2 == 0 else tuple(reversed(counts))


def _tok_s(point: dict, system: str) -> float | None:
    summary = point.get(system)
    return summary["throughput_tok_s"] if summary else None


def spread(values: list[float]) -> dict:
    """Median, range and the range relative to the median of a point's rounds."""
    assert values
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "rel_range": (max(values) - min(values)) / med if med else None, "n": len(values)}


def combine_rounds(rounds: list[dict]) -> dict:
    """One point from its rounds (each a runner.run_point result, in round order).

    The summaries (throughput, TTFT, ...) are the median round's, by loraplex output tok/s (the
    lower median for an even count), so every number in them comes from one run; the paired
    ratios are the medians of the rounds' own; "rounds" keeps each round's throughputs and ratios,
    and "loraplex_tok_s_spread" their spread (rounds with no throughput, an empty window, rank lowest).
    """
    assert rounds
    if len(rounds) == 1:
        return rounds[0]
    by_speed = sorted(rounds, key=lambda p: _tok_s(p, "loraplex") or 0.0)
    point = dict(by_speed[(len(by_speed) - 1) // 2])
    for key in PAIRED_RATIOS:
        values = [p[key] for p in rounds if p.get(key) is not None]
        if values:
            point[key] = statistics.median(values)
    point["rounds"] = [
        {**{f"{s}_tok_s": _tok_s(p, s) for s in SYSTEMS if p.get(s)},
         **{k: p[k] for k in PAIRED_RATIOS if p.get(k) is not None}}
        for p in rounds]
    if rounds[0].get("variant_throughput_ratios"):
        point["variant_throughput_ratios"] = median_ratios([p["variant_throughput_ratios"] for p in rounds])
        for r, p in zip(point["rounds"], rounds):
            r["variant_throughput_ratios"] = p["variant_throughput_ratios"]
    speeds = [_tok_s(p, "loraplex") for p in rounds if _tok_s(p, "loraplex") is not None]
    point["loraplex_tok_s_spread"] = spread(speeds) if speeds else None
    return point


def scaling_vs_fewest(rounds: dict[int, list[dict]]) -> dict[str, float] | None:
    """loraplex output tok/s at each adapter count over that at the fewest, paired by round
    (median over rounds); None with a single count."""
    counts = sorted(rounds)
    if len(counts) < 2:
        return None
    fewest = rounds[counts[0]]
    out = {}
    for n in counts[1:]:
        pairs = [_tok_s(p, "loraplex") / _tok_s(f, "loraplex")
                 for p, f in zip(rounds[n], fewest) if _tok_s(f, "loraplex")]
        if pairs:
            out[str(n)] = statistics.median(pairs)
    return out
