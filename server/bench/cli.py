"""`loraplex bench` / `benchmarks/serving/bench.py`: argument parsing and the run."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from server.config import ENGINE_PROCESSES, ServerConfig

DESCRIPTION = """\
Drive a seeded multi-tenant workload (power-law adapter popularity, gamma
arrivals) through loraplex over HTTP and, with --compare-peft, through a
transformers + peft baseline; print a table, write JSON and a PNG plot.
Example: bench --adapters 1,8,64 --requests 96 --compare-peft --json bench-out/cpu.json"""


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (integers), got {text!r}") from None
    return pair


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (integers), got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _pair(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ADAPTERS:SLOTS (integers), got {text!r}") from None


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--adapters", type=_counts, default=(8,), help="adapter count, or a sweep: 1,8,64,256")
    n = w.add_mutually_exclusive_group()
    n.add_argument("--requests", type=int, default=None,
                   help="requests per point (default 64; steady: the trace's length, default 20000; "
                        "structured: schemas of the suite sent, from the first, default all)")
    n.add_argument("--duration", type=float, default=None, help="seconds of arrivals (needs --rate)")
    w.add_argument("--rate", type=float, default=math.inf, help="requests/s; inf (default) = all at once")
    w.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of arrivals (1 = Poisson)")
    w.add_argument("--alpha", type=float, default=1.0, help="power-law popularity (1 uniform, <1 skewed)")
    w.add_argument("--prompt-len", type=_range, default=None, metavar="LO:HI",
                   help="default 8:64; with --workload prefix, each turn's new user message (default 64:64)")
    w.add_argument("--output-len", type=_range, default=(16, 64), metavar="LO:HI")
    w.add_argument("--tenants", type=int, default=4, help="adapter i belongs to tenant i mod T")
    w.add_argument("--base-share", type=float, default=None,
                   help="share of requests for the base model (default 0; structured workload: 0.25)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run the sweep N times, the order of points alternating; each point reports its median "
                        "round and ratios paired within rounds (for noisy machines)")
    w.add_argument("--rank", type=_counts, default=(16,), metavar="R[,R...]",
                   help="rank of the generated adapters, all 7 projections (default 16); several (16,8) are a "
                        "steady-workload sweep, run in the order given")
    w.add_argument("--ttft-slo", type=float, default=6.0, help="TTFT SLO in seconds (S-LoRA: 6)")
    w.add_argument("--workload", choices=("mixed", "prefix", "steady", "structured", "real"), default="mixed",
                   help="mixed (default): the trace as a burst or schedule; prefix: chat with a system prompt per "
                        "tenant and multi-turn history, run through the in-process engine with its prefix cache "
                        "off, then on (--requests counts turns); steady: fixed concurrency, measured over a "
                        "window after a warm-up, base against each adapter case (docs/benchmarks/gpu.md); structured: the "
                        "schema suite's validity under constraints and the throughput cost of constraining half of "
                        "--concurrency requests (docs/benchmarks/structured.md); real: the mixed trace "
                        "on SmolLM2-135M-Instruct (real weights, unless --model) with evaluation questions as "
                        "prompts and the shipped demo adapters")
    w.add_argument("--shared-prefix", type=int, default=512, metavar="N", help="prefix workload: system prompt tokens")
    w.add_argument("--turns", type=int, default=3, help="prefix workload: turns per conversation")
    w.add_argument("--turn-gap", type=float, default=1.0, metavar="S",
                   help="prefix workload: seconds between a conversation's turns")
    st = p.add_argument_group("steady workload")
    st.add_argument("--concurrency", type=_counts, default=None, metavar="C[,C...]",
                    help="requests kept in flight, refilled as they finish (default 64); structured workload: "
                         "requests at once (default 32)")
    st.add_argument("--steady-duration", type=float, default=60.0, metavar="S",
                    help="seconds of the measured window after the warm-up (default 60)")
    st.add_argument("--warmup", type=float, default=10.0, metavar="S",
                    help="seconds at full concurrency before the window opens (default 10)")
    st.add_argument("--popularity", type=_names, default=("uniform",), metavar="uniform,power,distinct",
                    help="adapter popularity cases: uniform, power (floor(n*u), u ~ power(--power-alpha)), "
                         "distinct (request i -> adapter i mod n: every adapter in each n in a row); "
                         "default uniform")
    st.add_argument("--power-alpha", type=float, default=0.3, help="power-law exponent (default 0.3)")
    st.add_argument("--churn", type=_pair, default=None, metavar="ADAPTERS:SLOTS",
                    help="also run a churn case: ADAPTERS adapters through SLOTS slots (default: none)")
    st.add_argument("--peft-check", type=int, default=0, metavar="N",
                    help="per adapter case, compare the trace's first N requests' token ids with "
                         "transformers + peft (default 0: no check)")
    st.add_argument("--device-bandwidth-gbps", type=float, default=None, metavar="GB/S",
                    help="memory bandwidth for the bounds (default: known devices' figure, H100 SXM 3350; "
                         "none on a CPU)")
    s_q = p.add_argument_group("engine variants")
    s_q.add_argument("--quantization", type=_names, default=("none",), metavar="none,int8",
                     help="loraplex serve's --quantization; several values (and --kv-cache-dtype values) run every "
                          "combination on each point, the first as the reference (default none)")
    s_q.add_argument("--kv-cache-dtype", type=_names, default=("auto",), metavar="auto,fp8_e4m3,fp8_e5m2",
                     help="loraplex serve's --kv-cache-dtype, likewise (default auto)")
    st.add_argument("--enforce-eager", action="store_true",
                    help="no decode CUDA graphs: the engine's and `loraplex serve`'s --enforce-eager (default "
                         "off; a CPU runs eager anyway)")
    s = p.add_argument_group("systems")
    s.add_argument("--target", choices=("http", "engine"), default=None,
                   help="http: a `loraplex serve` child (default); engine: in-process LLMEngine "
                        "(the default, and the only choice, for --workload prefix)")
    s.add_argument("--engine-process", choices=ENGINE_PROCESSES, default=None,
                   help="http target: the server's --engine-process (default: the server's own default, "
                        f"{ServerConfig.engine_process}); refused with --target engine")
    s.add_argument("--compare-peft", action="store_true", help="also run the transformers + peft baseline")
    s.add_argument("--baseline-max-batch", type=int, default=32)
    s.add_argument("--model", default=None, help="model directory (default: the demo model)")
    s.add_argument("--gpu", action="store_true", help="Llama-3-8B-shaped random model on CUDA in bf16")
    s.add_argument("--gpu-layers", type=int, default=None, help="with --gpu: fewer layers (smoke test)")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda with --gpu, else cpu)")
    s.add_argument("--dtype", default=None, help="default: bfloat16 with --gpu, else float32")
    s.add_argument("--max-loras", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=4096)
    s.add_argument("--cpu-threads", default="auto", metavar="auto|N",
                   help="torch threads for every side on a CPU device, recorded in the JSON (default auto)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default="bench-out/bench.json", help="where to write the JSON")
    o.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    o.add_argument("--per-tenant", action="store_true", help="print per-tenant rows")
    o.add_argument("--work-dir", default="bench-out", help="cache of adapters, demo model, server logs")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark loraplex against transformers + peft",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    return p


def config_from_args(args):
    from server.bench.runner import BenchConfig

    if args.requests is None and args.duration is None:
        # steady: the trace the concurrency loop draws from, long enough for the window; structured:
        # one request per schema of the suite
        if args.workload == "structured":
            from server.bench.schema_suite import load_suite

            args.requests = len(load_suite())
        else:
            args.requests = 20000 if args.workload == "steady" else 64
    device = args.device or ("cuda" if args.gpu else "cpu")
    dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    prefix = args.workload == "prefix"
    prompt_len = args.prompt_len or ((64, 64) if prefix else (8, 64))
    target = args.target or ("engine" if prefix else "http")
    structured = args.workload == "structured"
    concurrency = args.concurrency or ((32,) if structured else (64,))
    base_share = args.base_share if args.base_share is not None else (0.25 if structured else 0.0)
    return BenchConfig(
        adapter_counts=args.adapters, num_requests=args.requests, duration_s=args.duration, rate=args.rate,
        cv=args.cv, alpha=args.alpha, prompt_len=prompt_len, output_len=args.output_len,
        num_tenants=args.tenants, base_share=base_share, seed=args.seed, ranks=args.rank,
        target=target, compare_peft=args.compare_peft, model_dir=args.model, gpu=args.gpu,
        gpu_layers=args.gpu_layers, device=device, dtype=dtype, max_loras=args.max_loras,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        ttft_slo_s=args.ttft_slo, baseline_max_batch=args.baseline_max_batch, work_dir=args.work_dir,
        cpu_threads=args.cpu_threads, workload_type=args.workload, shared_prefix_len=args.shared_prefix,
        turns=args.turns, turn_gap_s=args.turn_gap, repeats=args.repeats, concurrency=concurrency,
        steady_s=args.steady_duration, warmup_s=args.warmup, popularity=args.popularity,
        power_alpha=args.power_alpha, churn=args.churn, peft_check=args.peft_check,
        device_bandwidth_gbps=args.device_bandwidth_gbps, enforce_eager=args.enforce_eager,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, engine_process=args.engine_process)


def run_bench(args) -> int:
    from server.bench.client import BenchClientError
    from server.bench.runner import BenchConfigError, run_bench as run
    from server.bench.workload import WorkloadError

    try:
        cfg = config_from_args(args)
        json_path = Path(args.json)
        doc = run(cfg, json_path, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (BenchConfigError, WorkloadError, BenchClientError, ValueError) as e:
        print(f"loraplex bench: error: {e}", file=sys.stderr)
        return 2
    report(doc, args, json_path)
    return 0


def report(doc: dict, args, json_path: Path) -> None:
    """The plot beside the JSON (or at --plot), then the table on stdout."""
    from server.bench.report import format_table, plot

    png = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    plot(doc, png)
    print(format_table(doc, per_tenant=args.per_tenant))
    print(f"wrote {json_path} and {png}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    return run_bench(p.parse_args(argv))
