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


class Victim:
    """The victim tenant's stream: one long greedy decode on the base model, the next started when one ends."""

    def __init__(self, engine: LLMEngine, tag: str) -> None:
        self.engine, self.tag, self.started = engine, tag, 0
        self.params = SamplingParams(max_tokens=engine.max_model_len - 3, temperature=0.0, ignore_eos=True)
        self.request_id = ""
        self.next()

    def next(self) -> None:
        self.request_id = f"{self.tag}-victim-{self.started}"
        self.started += 1
        self.engine.add_request(self.request_id, [7, 8, 9], self.params, tenant="victim")

    def decode_alone(self, steps: int, clock=time.perf_counter) -> list[float]:
        """The seconds of `steps` steps in which only the victim runs (the decode-only baseline), by `clock`
        (wall time, or time.thread_time for the step thread's CPU time)."""
        times = []
        for _ in range(steps):
            start = clock()
            self.engine.step()
            times.append(clock() - start)
        return times


def run_round(engine: LLMEngine, tag: str, args) -> dict:
    victim = Victim(engine, tag)
    decode_only = victim.decode_alone(args.warm_steps)
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
            if out.request_id != victim.request_id:
                ttft = end - arrived if out.finished else ttft
                continue
            gaps.append(end - start)
            if out.finished:  # a victim that reached max_model_len: the next one takes its place
                victim.next()
    engine.abort_request(victim.request_id)
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
    report(rounds, ("decode_only_p99_ms", "victim_gap_p50_ms", "victim_gap_p99_ms", "p99_vs_decode_only_p99",
                    "long_prompt_ttft_s"), args)


def report(rounds: dict[str, list[dict]], keys: tuple[str, ...], args) -> None:
    """Prints each setting's median over its rounds of `keys`, and writes every number to args.json (when set)."""
    width = max(map(len, rounds)) + 2
    print(f"{'setting':<{width}}" + "".join(f"{k:>{len(k) + 2}}" for k in keys))
    summary = {}
    for name, runs in rounds.items():
        summary[name] = {k: statistics.median(run[k] for run in runs) for k, v in runs[0].items()
                         if isinstance(v, (int, float))}
        print(f"{name:<{width}}" + "".join(f"{summary[name][k]:>{len(k) + 2}.3f}" for k in keys))
    out = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "load_at_end": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
           "median_of_rounds": summary, "rounds": rounds}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
