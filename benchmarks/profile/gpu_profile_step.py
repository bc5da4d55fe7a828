"""Decode steps on a CUDA GPU with and without CUDA graphs: whether graphed and eager runs give the same
tokens and, where not, why; step wall time, graph replay time, launches per step, where a step's device
time goes, capture seconds and memory.

Builds the Llama-3-8B-shaped random model in tmpfs and rank-16 adapters on all seven projections,
then, for each engine (graphs on: decode steps padded to a bucket replay a graph captured at start-up;
graphs off: --enforce-eager, unpadded, no graphs, the segmented LoRA kernels), for each point of
--seqs x --adapters (prefix caching off, so that every generation computes all of its tokens):
- token identity: greedy generation of --identity-tokens tokens per request with each token's logprob;
  with adapters, once more with every third row on the base model (base rows mixed into a LoRA batch);
- graph replay against its own launches (graphed engine): the same generations once more with the
  graphs set aside (PaddedDecode.graphs_off: the same padded contexts and kernels, run eagerly); tokens
  and logprobs must be bit-identical, any difference is a graph bug;
- graphed against unpadded eager (eager engine): for each request whose tokens differ, the first
  differing position and its margin: the eager engine teacher-forced to the common prefix (prompt
  logprobs, top 2) gives the gap between its top token and the graphed engine's token there; a gap
  within benchmarks.profile.token_divergence.NEAR_TIE_NATS is a near-tie (rounding), a larger one a
  MISMATCH; per point: requests compared, identical, the largest margin and a verdict;
- steady decode: every request prefilled, then the median wall time of --steps decode steps
  (synchronized), and for the graphed engine the median time of the bucket's graph replay alone
  (no host work at all: the device's time for the forward);
- launches and device time per step, from torch.profiler over 3 steps: kernel launches from the host
  (runtime and driver launch calls and graph launches), kernels run on the device, and device time per
  kernel name (top 15) and per class (benchmarks.profile.kernel_classes), for the graphed engine too
  where the profiler sees the kernels inside graph replays.
Writes everything to --json after every point (a killed run keeps what it has), prints one line per
point and tables at the end; exits 1 on a graph bug or a MISMATCH.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.profile.kernel_classes import CLASSES, kernel_report
from benchmarks.profile.token_divergence import (MISMATCH, NEAR_TIE_NATS, Divergence, Generated, Margin,
                                                 divergences, logprob_drift, not_bit_identical,
                                                 point_verdict)
from kernels import metadata
from server.bench.gpu_model import make_llama3_8b_shaped
from server.bench.synth_adapters import write_adapter
from server.engine import LLM, SamplingParams
from server.engine.decode_buffers import bucket_for

HOST_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch")
PROFILED_STEPS = 3
TOP_KERNELS = 15
TEACHER_FORCED_BATCH = 16  # requests per teacher-forced generate: bounds the prompt logprobs' memory
LISTED = 32  # divergences and request indices kept per point in the JSON


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    adapter: str | None


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


def point_batches(names: list[str], seqs: int, adapters: int, prompt_len: int) -> list[list[Request]]:
    """The point's generations, one batch of `seqs` requests each: every row on an adapter (names cycled)
    or the base model, and with adapters once more with every third row on the base model."""
    chosen = [names[i % adapters] if adapters else None for i in range(seqs)]
    prompts = [tuple(p) for p in prompts_for(seqs, prompt_len)]
    batches = [[Request(p, name) for p, name in zip(prompts, chosen)]]
    if adapters:  # base rows mixed in: every third row has no adapter, in the same captured graphs
        batches.append([Request(p, None if i % 3 == 2 else name) for i, (p, name) in enumerate(zip(prompts, chosen))])
    return batches


def generate(llm: LLM, batches: list[list[Request]], tokens: int) -> list[Generated]:
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    found = []
    for batch in batches:
        outs = llm.generate([list(r.prompt) for r in batch], greedy, adapters=[r.adapter for r in batch])
        found += [Generated(tuple(o.token_ids), tuple(e.logprob for e in o.logprobs)) for o in outs]
    return found


def teacher_forced_margins(llm: LLM, requests: list[Request], graphed: list[Generated],
                           found: list[Divergence]) -> list[Margin]:
    """For each divergence: the prompt, the common prefix and the graphed engine's token there, scored by
    `llm` (prompt logprobs, top 2): its top token at that last position and both tokens' logprobs. A
    divergence where the graphed generation had ended gets none."""
    scored = [d for d in found if d.graphed_token is not None]
    margins = []
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    for lo in range(0, len(scored), TEACHER_FORCED_BATCH):
        chunk = scored[lo: lo + TEACHER_FORCED_BATCH]
        prompts = [list(requests[d.request].prompt) + list(graphed[d.request].tokens[: d.position + 1])
                   for d in chunk]
        outs = llm.generate(prompts, params, adapters=[requests[d.request].adapter for d in chunk])
        for d, out in zip(chunk, outs):
            last = out.prompt_logprobs[-1]
            top_token, top_logprob = last.top[0]
            margins.append(Margin(d, top_token, top_logprob, last.logprob))
    return margins


def profile_steps(eng, steps: int = PROFILED_STEPS) -> dict:
    """Host launches and device kernels per step over `steps` steps, and where their device time goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    events = prof.events()
    host = sum(1 for e in events if any(e.name.startswith(n) for n in HOST_LAUNCHES))
    kernels = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    return {"host_launches": host / steps, "device_kernels": len(kernels) / steps,
            "device_time": kernel_report(kernels, steps, TOP_KERNELS)}


def drain(eng) -> None:
    for rid in list(eng.seqs):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()


def steady(llm: LLM, versions: dict[str, str], batch: list[Request], args) -> dict:
    """Step wall time, graph replay time and the profile, with every request of `batch` decoding."""
    eng = llm.engine
    seqs = len(batch)
    params = SamplingParams(max_tokens=args.steps * 3 + 40, temperature=0.0, ignore_eos=True)
    for i, r in enumerate(batch):
        eng.add_request(f"p{i}", list(r.prompt), params, versions[r.adapter] if r.adapter else None)
    started: set[str] = set()
    while len(started) < seqs:  # until every request has its first token
        started.update(out.request_id for out in eng.step())
    for _ in range(3):
        eng.step()
    replays = eng.stats().decode_graphs.replays
    point = {"step_ms": median_ms(eng.step, args.steps)}
    point["replayed_steps"] = eng.stats().decode_graphs.replays - replays
    padded = eng.runner.padded
    if padded is not None and padded.graphs:
        adapters = any(r.adapter for r in batch)
        graph = padded.graphs[bucket_for(seqs, padded.buckets), adapters, False][0]
        point["replay_ms"] = median_ms(graph.replay, args.steps)
    point.update(profile_steps(eng))
    drain(eng)
    return point


def replay_check(llm: LLM, batches: list[list[Request]], graphed: list[Generated], tokens: int) -> dict:
    """The graphed engine's generations again with its graphs set aside: bit-identical or a graph bug."""
    padded = llm.engine.runner.padded
    if padded is None or not padded.graphs:
        return {"compared": 0, "bit_identical": 0, "skipped": "no captured graphs"}
    with padded.graphs_off():
        again = generate(llm, batches, tokens)
    differ = not_bit_identical(graphed, again)
    same_tokens = sum(g.tokens == a.tokens for g, a in zip(graphed, again))
    return {"compared": len(graphed), "bit_identical": len(graphed) - len(differ), "same_tokens": same_tokens,
            "max_logprob_drift": logprob_drift(graphed, again), "differing_requests": differ[:LISTED]}


def compare(llm: LLM, requests: list[Request], graphed: list[Generated], eager: list[Generated]) -> dict:
    """Graphed against unpadded eager tokens, each divergence's margin from `llm` (the eager engine); the
    largest margins listed, with each engine's own logprob of its token there (from its decode step)."""
    found = divergences([g.tokens for g in graphed], [e.tokens for e in eager])
    margins = teacher_forced_margins(llm, requests, graphed, found)
    verdict = point_verdict(len(requests), found, margins)
    listed = []
    for m in sorted(margins, key=lambda m: -m.gap)[:LISTED]:
        d = m.divergence
        listed.append({**asdict(d), "adapter": requests[d.request].adapter, "top_token": m.top_token,
                       "top_logprob": m.top_logprob, "graphed_logprob": m.graphed_logprob, "gap": m.gap,
                       "verdict": m.verdict(), "graphed_own_logprob": _own(graphed[d.request], d.position),
                       "eager_own_logprob": _own(eager[d.request], d.position)})
    return {**asdict(verdict), "divergences": listed}


def _own(g: Generated, position: int) -> float | None:
    return g.logprobs[position] if position < len(g.logprobs) else None


def open_engine(model: Path, adapter_dirs: list[Path], graphs: bool, args) -> tuple[LLM, dict[str, str], dict]:
    llm = LLM(str(model), device="cuda", dtype="bfloat16", max_loras=max(max(args.adapters), 1), max_lora_rank=16,
              max_num_seqs=max(args.seqs), enforce_eager=not graphs, enable_prefix_caching=False)
    versions = {f"a{i}": llm.add_adapter(f"a{i}", d) for i, d in enumerate(adapter_dirs)}
    s = llm.engine.stats()
    result = {"graphs": graphs, "cuda_graphs": s.decode_graphs.graphs,
              "capture_seconds": s.decode_graphs.capture_seconds,
              "capture_mib": s.decode_graphs.capture_bytes / (1 << 20), "warmup_seconds": llm.engine.warmup_seconds,
              "points": []}
    return llm, versions, result


def close_engine(llm: LLM) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def run_graphed(model: Path, dirs: list[Path], args, report: dict, out: Path) -> dict[tuple[int, int], list[Generated]]:
    llm, versions, report["graphed"] = open_engine(model, dirs, True, args)
    names = list(versions)
    tokens = {}
    for seqs in args.seqs:
        for adapters in args.adapters:
            batches = point_batches(names, seqs, adapters, args.prompt_len)
            tokens[seqs, adapters] = generate(llm, batches, args.identity_tokens)
            point = {"seqs": seqs, "adapters": adapters,
                     "padded_eager": replay_check(llm, batches, tokens[seqs, adapters], args.identity_tokens),
                     **steady(llm, versions, batches[0], args)}
            report["graphed"]["points"].append(point)
            write(out, report)
            print(json.dumps({"graphs": True, **summary_fields(point)}), flush=True)
    close_engine(llm)
    return tokens


def run_eager(model: Path, dirs: list[Path], args, report: dict, out: Path,
              graphed: dict[tuple[int, int], list[Generated]]) -> None:
    llm, versions, report["eager"] = open_engine(model, dirs, False, args)
    names = list(versions)
    for seqs in args.seqs:
        for adapters in args.adapters:
            batches = point_batches(names, seqs, adapters, args.prompt_len)
            eager = generate(llm, batches, args.identity_tokens)
            key = f"{seqs}x{adapters}"
            requests = [r for batch in batches for r in batch]
            report["comparison"][key] = compare(llm, requests, graphed[seqs, adapters], eager)
            report["tokens_identical"][key] = report["comparison"][key]["verdict"] == "identical"
            point = {"seqs": seqs, "adapters": adapters, **steady(llm, versions, batches[0], args)}
            report["eager"]["points"].append(point)
            write(out, report)
            verdict = {k: v for k, v in report["comparison"][key].items() if k != "divergences"}
            print(json.dumps({"graphs": False, **summary_fields(point), **verdict}), flush=True)
    close_engine(llm)


def summary_fields(point: dict) -> dict:
    return {k: v for k, v in point.items() if k != "device_time"}


def write(out: Path, report: dict) -> None:
    out.write_text(json.dumps(report, indent=1) + "\n")


def graph_bugs(report: dict) -> list[str]:
    return [f"{p['seqs']}x{p['adapters']}" for p in report["graphed"]["points"]
            if p["padded_eager"]["bit_identical"] != p["padded_eager"]["compared"]]


def print_tables(report: dict) -> None:
    graphed, eager = report["graphed"], report["eager"]
    print(f"capture: {graphed['cuda_graphs']} graphs in {graphed['capture_seconds']:.1f} s, "
          f"{graphed['capture_mib']:.0f} MiB")
    print(f"{'seqs':>5} {'adapters':>8} {'eager ms':>9} {'graphed ms':>10} {'replay ms':>9} "
          f"{'launches eager/graphed':>23} {'replay=own launches':>19} {'same':>7} {'max margin':>10} verdict")
    for g, e in zip(graphed["points"], eager["points"]):
        c = report["comparison"][f"{g['seqs']}x{g['adapters']}"]
        pe = g["padded_eager"]
        margin = "" if c["max_margin"] is None else f"{c['max_margin']:.4f}"
        replayed = "skipped" if "skipped" in pe else f"{pe['bit_identical']:>9}/{pe['compared']:<9}"
        print(f"{g['seqs']:>5} {g['adapters']:>8} {e['step_ms']:>9.2f} {g['step_ms']:>10.2f} "
              f"{g.get('replay_ms', float('nan')):>9.2f} {e['host_launches']:>11.0f}/{g['host_launches']:<11.0f} "
              f"{replayed:>19} {c['identical']:>3}/{c['compared']:<3} {margin:>10} "
              f"{c['verdict']}")
    print("device ms per step by class, eager / graphed (graphed: kernels inside replays, if the profiler saw them)")
    print(f"{'seqs':>5} {'adapters':>8} " + " ".join(f"{c:>16}" for c in CLASSES))
    for g, e in zip(graphed["points"], eager["points"]):
        cells = [f"{ce['us_per_step'] / 1e3:.2f}/{cg['us_per_step'] / 1e3:.2f}"
                 for ce, cg in zip(e["device_time"]["classes"], g["device_time"]["classes"])]
        print(f"{g['seqs']:>5} {g['adapters']:>8} " + " ".join(f"{c:>16}" for c in cells))
    for e in eager["points"]:
        top = ", ".join(f"{k['name'][:40]} {k['us_per_step'] / 1e3:.2f} ms x{k['count_per_step']:.0f}"
                        for k in e["device_time"]["kernels"][:5])
        print(f"eager {e['seqs']}x{e['adapters']} top kernels: {top}")


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
    out = Path(args.json)
    metadata.PADDED_LORA_FORM = args.padded_lora_form  # read when the engine builds its padded steps
    model = make_llama3_8b_shaped(args.model_dir, num_layers=args.layers)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "near_tie_nats": NEAR_TIE_NATS,
              "padded_lora_form": args.padded_lora_form,
              "graphed": {}, "eager": {}, "comparison": {}, "tokens_identical": {}}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_adapter(model, Path(tmp) / f"a{i}", r=16, seed=i) for i in range(max(args.adapters))]
        graphed_tokens = run_graphed(model, dirs, args, report, out)
        run_eager(model, dirs, args, report, out, graphed_tokens)
    print_tables(report)
    bugs = graph_bugs(report)
    mismatches = [k for k, c in report["comparison"].items() if c["verdict"] == MISMATCH]
    if bugs:
        print(f"GRAPH BUG: a replayed graph and the same padded launches run eagerly differ at {', '.join(bugs)}")
    if mismatches:
        print(f"MISMATCH: graphed and eager tokens differ by more than {NEAR_TIE_NATS} nats at {', '.join(mismatches)}")
    return 1 if bugs or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
