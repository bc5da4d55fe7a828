"""Where a CUDA engine step's time goes: wall time, the forward eager against a replayed CUDA graph, top ops.

Builds the Llama-3-8B-shaped random model in tmpfs, fills the engine with --seqs requests (one adapter
each, round-robin over --adapters; 0: base model), runs their prefill, then times decode steps:
wall time per step (synchronized); one step's forward alone, eager and replayed as a CUDA graph (the
replay has no host work, so it is the device's time); then torch.profiler over a few steps for the ops'
host and device time. A forward whose eager time is far over its replay is bound by the host.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.bench.gpu_model import make_llama3_8b_shaped  # noqa: E402
from server.bench.synth_adapters import write_adapter  # noqa: E402
from server.engine import LLM, SamplingParams  # noqa: E402


def median_ms(fn, n: int = 20) -> float:
    """Median wall time of fn() in ms, synchronized before and after each call."""
    walls = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    return 1e3 * statistics.median(walls)


def graph_replay(eng, adapters: int) -> None:
    """The same decode forward eager and as a replayed CUDA graph: the host's share of a step."""
    model = eng.runner.model
    forward, seen = model.forward, {}

    def spy(*a, **k):
        seen["call"] = (a, k)
        return forward(*a, **k)

    model.forward = spy
    eng.step()
    model.forward = forward
    a, k = seen["call"]

    print(f"decode forward alone, {adapters} adapters: eager {median_ms(lambda: forward(*a, **k)):.2f} ms")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward(*a, **k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(*a, **k)
        print(f"decode forward alone, {adapters} adapters: CUDA graph replay {median_ms(graph.replay):.2f} ms")
    except Exception as e:  # what stops capture is the finding
        print(f"CUDA graph capture failed: {type(e).__name__}: {str(e)[:600]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model-dir", default="/dev/shm/loraplex-warmup-8b")
    args = p.parse_args()
    model = make_llama3_8b_shaped(args.model_dir, num_layers=args.layers)
    llm = LLM(str(model), device="cuda", dtype="bfloat16", max_loras=max(args.adapters, 1), max_lora_rank=16)
    names = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            names.append(f"a{i}")
            llm.add_adapter(names[-1], write_adapter(model, Path(tmp) / f"a{i}", r=8, seed=i))
    eng = llm.engine
    params = SamplingParams(max_tokens=2048, temperature=0.0, ignore_eos=True)
    for i in range(args.seqs):
        name = names[i % len(names)] if names else None
        eng.add_request(f"r{i}", [5 + (i + j) % 400 for j in range(args.prompt_len)], params,
                        llm._versions[name] if name else None)
    t = time.perf_counter()
    steps = 0
    started: set[str] = set()
    while len(started) < args.seqs and steps < 1000:  # until every request has its first token
        started.update(out.request_id for out in eng.step())
        steps += 1
    torch.cuda.synchronize()
    print(f"prefill of {args.seqs} x {args.prompt_len} tokens: {steps} steps, {time.perf_counter() - t:.2f} s")
    print(f"decode step, {args.seqs} seqs, {args.adapters} adapters: wall median "
          f"{median_ms(eng.step, args.steps):.1f} ms")
    graph_replay(eng, args.adapters)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()  # an op's CUDA time and its kernels' appear on separate rows: don't sum them
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
