#!/usr/bin/env python3
"""Activated LoRA and the prefix cache: time to first token of a second aLoRA on the same prompt.

Two adapters on one `--prompt-len`-token prompt whose invocation sequence is
at its end (the way an aLoRA is called: the conversation so far, then the
invocation). The first request prefills the prompt; the second, for the other
adapter, is timed. As aLoRAs, everything before the invocation is the base
model's KV, which the first request left in the prefix cache: the second
prefills only the last block. The same weights served as plain LoRAs (the
config without `alora_invocation_tokens`, "aLoRA treated as plain LoRA")
share nothing, and the second prefills the whole prompt again.

The smol135 shape (benchmarks.model_shape), one engine holding all four
adapters with the prefix cache on, requests one at a time (max_tokens 1).
Each round takes a fresh prompt and times both modes, the order flipping
every round so a shared machine loads both alike; the table reports medians.
Prints a table and writes JSON.

    .venv/bin/python -m benchmarks.engine.bench_alora --json docs/benchmarks/alora-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.model_shape import build_model_shape
from server.demo import make_adapter
from server.engine import LLM, SamplingParams

INVOCATION = [17, 42, 99]  # ordinary ids of the demo tokenizer's vocabulary
MODES = {"alora": ("alora-1", "alora-2"), "plain": ("plain-1", "plain-2")}


def write_adapters(model_dir: Path, root: Path, rank: int) -> dict[str, Path]:
    """Two adapters (different weights), each written as an aLoRA and as the same plain LoRA."""
    dirs = {}
    for i in (1, 2):
        plain = make_adapter(model_dir, root / f"plain-{i}", r=rank, lora_alpha=2 * rank, seed=i)
        alora = root / f"alora-{i}"
        alora.mkdir()
        (alora / "adapter_model.safetensors").write_bytes((plain / "adapter_model.safetensors").read_bytes())
        cfg = json.loads((plain / "adapter_config.json").read_text())
        (alora / "adapter_config.json").write_text(json.dumps({**cfg, "alora_invocation_tokens": INVOCATION}))
        dirs[f"plain-{i}"], dirs[f"alora-{i}"] = plain, alora
    return dirs


def ttft(llm: LLM, rid: str, prompt: list[int], adapter: str) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the prompt tokens served from the cache."""
    engine = llm.engine
    hits = engine.stats().prefix_cache.hit_tokens
    t = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       llm._versions[adapter])
    while True:
        outs = engine.step()
        if any(o.request_id == rid and o.token_ids for o in outs):
            seconds = time.perf_counter() - t
            break
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, engine.stats().prefix_cache.hit_tokens - hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens, invocation included (default 512)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank of both adapters (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, a fresh prompt each (default 5)")
    ap.add_argument("--model-dir", help="where the smol135-shaped model is built or reused (default: a temp dir)")
    ap.add_argument("--json", default="bench-out/alora-cpu.json", help="output (default bench-out/alora-cpu.json)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_shape("smol135", args.model_dir or Path(tmp) / "smol135")
        dirs = write_adapters(model_dir, Path(tmp), args.rank)
        # Two prompts in flight at most, and room for the first one's blocks to stay cached meanwhile.
        blocks = 4 * (args.prompt_len // 16 + 2) + 16
        llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=4, max_lora_rank=args.rank,
                  kv_cache_blocks=blocks, max_model_len=args.prompt_len + 16,
                  max_num_batched_tokens=args.prompt_len)
        llm.engine.set_prefix_cache_policy(True)
        for name, path in dirs.items():
            llm.add_adapter(name, path)
        rng = random.Random(0)

        def prompt() -> list[int]:
            # Ids 100..: the invocation occurs only where it is put, at the end.
            return [rng.randrange(100, 500) for _ in range(args.prompt_len - len(INVOCATION))] + INVOCATION

        for mode, (first, second) in MODES.items():  # warm-up: every adapter in a slot, every path run once
            warm = prompt()
            ttft(llm, f"warm-{mode}-1", warm, first)
            ttft(llm, f"warm-{mode}-2", warm, second)
        rounds = []
        for r in range(args.rounds):
            row = {}
            for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
                first, second = MODES[mode]
                shared = prompt()
                row[f"{mode}_first_s"], _ = ttft(llm, f"r{r}-{mode}-1", shared, first)
                row[f"{mode}_second_s"], row[f"{mode}_second_cached_tokens"] = ttft(
                    llm, f"r{r}-{mode}-2", shared, second)
            row["speedup"] = row["plain_second_s"] / row["alora_second_s"]
            rounds.append(row)
            print(f"round {r}: second request TTFT aLoRA {1000 * row['alora_second_s']:.1f} ms "
                  f"({row['alora_second_cached_tokens']} cached), plain LoRA {1000 * row['plain_second_s']:.1f} ms "
                  f"({row['plain_second_cached_tokens']} cached): x{row['speedup']:.1f}", flush=True)
    load_after = os.getloadavg()
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"\n{'mode':<28} {'1st TTFT ms':>12} {'2nd TTFT ms':>12} {'2nd cached tokens':>18}")
    for mode, label in (("plain", "aLoRA treated as plain LoRA"), ("alora", "aLoRA")):
        print(f"{label:<28} {1000 * med[f'{mode}_first_s']:>12.1f} {1000 * med[f'{mode}_second_s']:>12.1f} "
              f"{med[f'{mode}_second_cached_tokens']:>18.0f}")
    print(f"second request's TTFT: x{med['speedup']:.1f} lower as aLoRA (median of {args.rounds} rounds; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": "smol135 shape (random weights)", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
        "invocation_len": len(INVOCATION), "rank": args.rank, "block_size": llm.engine.config.cache.block_size,
        "load_average_before": load_before, "load_average_after": load_after,
        "rounds": rounds, "median": med, "median_speedup_second_ttft": med["speedup"],
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
