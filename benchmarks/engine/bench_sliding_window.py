#!/usr/bin/env python3
"""KV blocks a sliding-window conversation holds, against its window's blocks.

A multi-turn conversation, as a chat client sends it: each turn is a new request whose prompt is the
whole history so far plus `--user` new tokens, answered with `--reply` greedy tokens, until the
history is `--length-x` times the window. The prefix cache serves each turn's history. After every
engine step the blocks the conversation's sequence holds are counted (its block table less the
entries released behind the window), while decoding and over every step (prompt chunks included).

Two tiny random models with the same window: Mistral (every layer windowed: blocks wholly behind the
window go back to the pool) and Gemma 2 (sliding layers interleaved with global ones, which read every
position: the paged cache keeps every block). Target (issue 37): the all-windowed conversation at
4x its window holds <= 1.2x the window's blocks. Prints a table and writes JSON.

    .venv/bin/python -m benchmarks.engine.bench_sliding_window --json docs/benchmarks/sliding-window-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from server.demo import make_base_model
from server.engine import LLM, SamplingParams
from server.engine.block_manager import FREED
from server.engine.sliding_window import sequence_blocks

# label -> (arch, its window config, KV pool in windows' blocks; None: room for the whole conversation)
MODELS = {
    "mistral (every layer windowed)": ("mistral", lambda w: {"sliding_window": w}, None),
    "mistral, pool of 1.25 windows": ("mistral", lambda w: {"sliding_window": w}, 1.25),
    "gemma2 (sliding + global layers)": ("gemma2", lambda w: {"sliding_window": w, "layer_types": [
        "sliding_attention", "full_attention"]}, None),
}


def conversation(llm: LLM, window: int, length_x: float, user: int, reply: int, seed: int) -> dict:
    """Runs the turns; the blocks held per step, split into decode steps and all steps."""
    engine = llm.engine
    rng = random.Random(seed)
    history: list[int] = []
    decode_peak = step_peak = turns = steps = 0
    hits = engine.stats().prefix_cache.hit_tokens
    params = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    while len(history) < length_x * window:
        history += [rng.randrange(3, 500) for _ in range(user)]
        rid = f"turn-{turns}"
        engine.add_request(rid, history, params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = o
            steps += 1
            for seq in engine.scheduler.running:
                held = sum(b != FREED for b in seq.block_table)
                step_peak = max(step_peak, held)
                if seq.num_pending_tokens == 1 and seq.num_output_tokens >= 2:  # the step just run decoded
                    decode_peak = max(decode_peak, held)
        history += out.token_ids
        turns += 1
    return {"turns": turns, "steps": steps, "final_tokens": len(history), "decode_peak_blocks": decode_peak,
            "peak_blocks": step_peak, "prefix_hit_tokens": engine.stats().prefix_cache.hit_tokens - hits,
            "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=4096, help="sliding window in tokens (default 4096, Mistral 7B v0.1's)")
    ap.add_argument("--length-x", type=float, default=4.0, help="conversation length in windows (default 4)")
    ap.add_argument("--user", type=int, default=200, help="new user tokens per turn (default 200)")
    ap.add_argument("--reply", type=int, default=56, help="generated tokens per turn (default 56)")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (default 512)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", default="bench-out/sliding-window-cpu.json",
                    help="output (default bench-out/sliding-window-cpu.json)")
    args = ap.parse_args()
    b = args.block_size
    window_blocks = -(-args.window // b)
    max_len = int(args.length_x * args.window) + args.user + args.reply + b
    load_before = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (arch, overrides, pool_x) in MODELS.items():
            model_dir = Path(tmp) / arch
            if not model_dir.exists():
                make_base_model(model_dir, arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=128, max_position_embeddings=max_len,
                                config_overrides=overrides(args.window))
            # Room for the whole conversation (the interleaved model needs it), or a pool of pool_x windows,
            # which an all-windowed conversation of any length runs in.
            blocks = (-(-max_len // b) + 8 if pool_x is None else
                      max(int(pool_x * window_blocks), sequence_blocks(max_len, b, args.window, args.chunk) + 1))
            llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_blocks=blocks,
                      max_model_len=max_len, max_num_batched_tokens=args.chunk, block_size=b, max_loras=1)
            llm.engine.set_prefix_cache_policy(True)
            row = conversation(llm, args.window, args.length_x, args.user, args.reply, seed=0)
            row["kv_window"] = llm.engine.model_config.kv_window
            row["pool_blocks"] = blocks
            row["preemptions"] = llm.engine.stats().scheduler.preemptions
            row["decode_peak_x_window"] = row["decode_peak_blocks"] / window_blocks
            row["peak_x_window"] = row["peak_blocks"] / window_blocks
            rows[label] = row
            print(f"{label}: {row['turns']} turns to {row['final_tokens']} tokens in {row['seconds']:.1f} s", flush=True)
    load_after = os.getloadavg()
    print(f"\nwindow {args.window} tokens = {window_blocks} blocks of {b}; conversation to {args.length_x}x the window; "
          f"turns of {args.user} user + {args.reply} generated tokens; chunks of {args.chunk}")
    print(f"{'model':<34} {'pool':>5} {'decode peak':>12} {'x window':>9} {'peak (chunks)':>14} {'x window':>9} "
          f"{'hit tokens':>11} {'preempted':>10}")
    for label, r in rows.items():
        print(f"{label:<34} {r['pool_blocks']:>5} {r['decode_peak_blocks']:>12} {r['decode_peak_x_window']:>9.3f} "
              f"{r['peak_blocks']:>14} {r['peak_x_window']:>9.3f} {r['prefix_hit_tokens']:>11} {r['preemptions']:>10}")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": "cpu", "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "model": "tiny random (hidden 64, 2 layers, 4 heads / 2 KV heads)",
        "window": args.window, "window_blocks": window_blocks, "block_size": b, "length_x": args.length_x,
        "user_tokens_per_turn": args.user, "reply_tokens_per_turn": args.reply, "max_num_batched_tokens": args.chunk,
        "target_x_window": 1.2, "load_average_before": load_before, "load_average_after": load_after,
        "models": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
