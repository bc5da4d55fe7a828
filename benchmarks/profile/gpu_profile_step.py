"""Decode steps on a CUDA GPU with and without CUDA graphs: step wall time, graph replay time, launches
per step, capture seconds and memory, and whether graphed and eager runs give the same tokens.

Builds the Llama-3-8B-shaped random model in tmpfs and rank-16 adapters on all seven projections,
then, for each engine (graphs on: decode steps padded to a bucket replay a graph captured at start-up;
graphs off: --enforce-eager), for each point of --seqs x --adapters:
- token identity: greedy generation of --identity-tokens tokens per request, token ids kept; with
  adapters, once more with every third row on the base model (base rows mixed into a LoRA batch);
- steady decode: every request prefilled, then the median wall time of --steps decode steps
  (synchronized), and for the graphed engine the median time of the bucket's graph replay alone
  (no host work at all: the device's time for the forward);
- launches per step: kernel launches from the host (runtime and driver launch calls and graph
  launches) and kernels run on the device, from torch.profiler over 3 steps.
Writes everything to --json and prints a table; graphed/eager token mismatches are listed.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernels import metadata
from server.bench.gpu_model import make_llama3_8b_shaped
from server.bench.synth_adapters import write_adapter
from server.engine import LLM, SamplingParams
from server.engine.decode_buffers import bucket_for

HOST_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch")


def median_ms(fn, n: int) -> float:
    """Median wall time of fn() in ms, synchronized before and after each call."""
    walls = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    return 1e3 * statistics.median(walls)


def prompts_for(seqs: int, prompt_len: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 400 for j in range(prompt_len)] for i in range(seqs)]


def launches_per_step(eng, steps: int = 3) -> dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    events = prof.events()
    host = sum(1 for e in events if any(e.name.startswith(n) for n in HOST_LAUNCHES))
    device = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    return {"host_launches": host / steps, "device_kernels": device / steps}


def drain(eng) -> None:
    for rid in list(eng.seqs):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()


def run_point(llm: LLM, names: list[str], seqs: int, adapters: int, args) -> tuple[dict, list[list[int]]]:
    eng = llm.engine
    chosen = [names[i % adapters] if adapters else None for i in range(seqs)]
    prompts = prompts_for(seqs, args.prompt_len)
    greedy = SamplingParams(max_tokens=args.identity_tokens, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, greedy, adapters=chosen)]
    if adapters:  # base rows mixed in: every third row has no adapter, in the same captured graphs
        mixed = [None if i % 3 == 2 else name for i, name in enumerate(chosen)]
        tokens += [o.token_ids for o in llm.generate(prompts, greedy, adapters=mixed)]
    params = SamplingParams(max_tokens=args.steps * 3 + 40, temperature=0.0, ignore_eos=True)
    for i, (prompt, name) in enumerate(zip(prompts, chosen)):
        eng.add_request(f"p{i}", prompt, params, llm._versions[name] if name else None)
    started: set[str] = set()
    while len(started) < seqs:  # until every request has its first token
        started.update(out.request_id for out in eng.step())
    for _ in range(3):
        eng.step()
    replays = eng.stats().decode_graphs.replays
    point = {"seqs": seqs, "adapters": adapters, "step_ms": median_ms(eng.step, args.steps)}
    point["replayed_steps"] = eng.stats().decode_graphs.replays - replays
    padded = eng.runner.padded
    if padded is not None:
        graph = padded.graphs[bucket_for(seqs, padded.buckets), adapters > 0, False][0]
        point["replay_ms"] = median_ms(graph.replay, args.steps)
    point.update(launches_per_step(eng))
    drain(eng)
    return point, tokens


def run_engine(model: Path, adapter_dirs: list[Path], graphs: bool, args) -> tuple[dict, dict]:
    llm = LLM(str(model), device="cuda", dtype="bfloat16", max_loras=max(max(args.adapters), 1), max_lora_rank=16,
              max_num_seqs=max(args.seqs), enforce_eager=not graphs)
    names = []
    for i, d in enumerate(adapter_dirs):
        names.append(f"a{i}")
        llm.add_adapter(names[-1], d)
    s = llm.engine.stats()
    result = {"graphs": graphs, "cuda_graphs": s.decode_graphs.graphs,
              "capture_seconds": s.decode_graphs.capture_seconds,
              "capture_mib": s.decode_graphs.capture_bytes / (1 << 20), "warmup_seconds": llm.engine.warmup_seconds,
              "points": []}
    tokens = {}
    for seqs in args.seqs:
        for adapters in args.adapters:
            point, toks = run_point(llm, names, seqs, adapters, args)
            result["points"].append(point)
            tokens[seqs, adapters] = toks
            print(json.dumps({"graphs": graphs, **point}), flush=True)
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: Llama-3-8B's 32)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256], help="batch sizes (default 1 64 256)")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 8, 64],
                   help="distinct rank-16 adapters per point, all seven projections (default 0 1 8 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per point (default 20)")
    p.add_argument("--identity-tokens", type=int, default=16,
                   help="greedy tokens per request compared between graphed and eager (default 16)")
    p.add_argument("--model-dir", default="/dev/shm/loraplex-warmup-8b", help="where the random model is built")
    p.add_argument("--json", default="docs/benchmarks/gpu-profile-step.json", help="output file")
    p.add_argument("--padded-lora-form", choices=["gathered", "tiled"], default=metadata.PADDED_LORA_FORM,
                   help="the padded decode steps' LoRA plan (kernels.metadata.PADDED_LORA_FORM, default "
                        f"{metadata.PADDED_LORA_FORM}): run once with each to compare them (docs/engine.md)")
    args = p.parse_args(argv)
    metadata.PADDED_LORA_FORM = args.padded_lora_form  # read when the engine builds its padded steps
    model = make_llama3_8b_shaped(args.model_dir, num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_adapter(model, Path(tmp) / f"a{i}", r=16, seed=i) for i in range(max(args.adapters))]
        graphed, graphed_tokens = run_engine(model, dirs, True, args)
        eager, eager_tokens = run_engine(model, dirs, False, args)
    identical = {f"{s}x{a}": graphed_tokens[s, a] == eager_tokens[s, a] for s, a in graphed_tokens}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "padded_lora_form": args.padded_lora_form, "graphed": graphed,
              "eager": eager, "tokens_identical": identical}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"capture: {graphed['cuda_graphs']} graphs in {graphed['capture_seconds']:.1f} s, "
          f"{graphed['capture_mib']:.0f} MiB")
    print(f"{'seqs':>5} {'adapters':>8} {'eager ms':>9} {'graphed ms':>10} {'replay ms':>9} "
          f"{'launches eager/graphed':>23} {'same tokens':>11}")
    for g, e in zip(graphed["points"], eager["points"]):
        key = f"{g['seqs']}x{g['adapters']}"
        print(f"{g['seqs']:>5} {g['adapters']:>8} {e['step_ms']:>9.2f} {g['step_ms']:>10.2f} "
              f"{g.get('replay_ms', float('nan')):>9.2f} {e['host_launches']:>11.0f}/{g['host_launches']:<11.0f} "
              f"{str(identical[key]):>11}")
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
