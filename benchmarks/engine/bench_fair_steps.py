#!/usr/bin/env python3
"""Fair steps at the engine level (docs/engine.md "Fair steps"): what one tenant's in-budget long prompt with
prompt logprobs (bench_abuse's logprob_echo_in_budget: a prompt of max_model_len - 2 ids, top-20 logprobs
over every position, one output token) does to a decoding stream's inter-token time, under the static prefill
cap (`--max-prefill-tokens-while-decoding 256`, the old auto) and the latency-aware one (auto on a CPU:
the cap bounded to --ratio of a decode-only step's measured time), in paired rounds on the demo model.

Each round, per setting: a victim decodes alone for --warm-steps (the decode-only baseline and the
estimates' warm-up), then the long prompt arrives; the victim's gaps (step times of the steps that gave
it a token) while the prompt is prefilled, against its own decode-only steps of that round, and the long
prompt's time to its first token. No HTTP: only the engine's step loop, so the ratios are the schedule's.

    .venv/bin/python -m benchmarks.engine.bench_fair_steps --rounds 3 --json docs/benchmarks/fair-steps-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from server.demo import ensure_demo
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.config import CPU_PREFILL_CAP, CPU_PREFILL_STEP_RATIO


def build(model_dir: Path, ratio: float | None, args) -> LLMEngine:
    return LLMEngine(EngineConfig.of(
        model=str(model_dir), device="cpu", max_num_seqs=8, max_num_batched_tokens=2048,
        max_prefill_tokens_while_decoding=CPU_PREFILL_CAP, max_prefill_step_ratio=ratio,
        cpu_threads=args.cpu_threads))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_round(engine: LLMEngine, tag: str, args) -> dict:
    victims = iter(range(1_000_000))
    victim = f"{tag}-victim-{next(victims)}"
    params = SamplingParams(max_tokens=engine.max_model_len - 3, temperature=0.0, ignore_eos=True)
    engine.add_request(victim, [7, 8, 9], params, tenant="victim")
    decode_only: list[float] = []
    for _ in range(args.warm_steps):
        start = time.perf_counter()
        engine.step()
        decode_only.append(time.perf_counter() - start)
    prompt = [5] * (engine.max_model_len - 2)
    engine.add_request(f"{tag}-long", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20,
                                                             prompt_logprobs=20), tenant="attacker")
    arrived = time.perf_counter()
    gaps: list[float] = []
    ttft = None
    while ttft is None:
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        for out in outputs:
            if out.request_id != victim:
                ttft = end - arrived if out.finished else ttft
                continue
            gaps.append(end - start)
            if out.finished:  # a victim that reached max_model_len: the next one takes its place
                victim = f"{tag}-victim-{next(victims)}"
                engine.add_request(victim, [7, 8, 9], params, tenant="victim")
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        engine.step()
    base = statistics.median(decode_only)
    return {"decode_only_p50_ms": base * 1e3, "decode_only_p99_ms": p99(decode_only) * 1e3,
            "victim_gap_p50_ms": statistics.median(gaps) * 1e3, "victim_gap_p99_ms": p99(gaps) * 1e3,
            "victim_gap_max_ms": max(gaps) * 1e3, "p99_vs_decode_only_p99": p99(gaps) / p99(decode_only),
            "p50_vs_decode_only_p50": statistics.median(gaps) / base, "victim_tokens_during": len(gaps),
            "long_prompt_ttft_s": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-steps", type=int, default=200)
    ap.add_argument("--cpu-threads", default="1", help="the engine's intra-op threads (default 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    demo = ensure_demo(Path(tempfile.gettempdir()) / "loraplex-bench-demo")
    settings = {"static 256": None, f"auto ({CPU_PREFILL_STEP_RATIO}x)": CPU_PREFILL_STEP_RATIO}
    engines = {name: build(demo.model_dir, ratio, args) for name, ratio in settings.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in settings}
    for r in range(args.rounds):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for name in order:
            rounds[name].append(run_round(engines[name], f"r{r}", args))
    keys = ("decode_only_p99_ms", "victim_gap_p50_ms", "victim_gap_p99_ms", "p99_vs_decode_only_p99",
            "long_prompt_ttft_s")
    print(f"{'setting':<14}" + "".join(f"{k:>26}" for k in keys))
    summary = {}
    for name, runs in rounds.items():
        summary[name] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"{name:<14}" + "".join(f"{summary[name][k]:>26.3f}" for k in keys))
    report = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "load_at_end": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
              "median_of_rounds": summary, "rounds": rounds}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
