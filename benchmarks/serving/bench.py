#!/usr/bin/env python3
"""loraplex vs transformers + peft (and, with --peer, vLLM's CPU server) on a seeded workload.

    .venv/bin/python -m benchmarks.serving.bench --adapters 8 --requests 64 --compare-peft --json bench-out/bench.json
    .venv/bin/python -m benchmarks.serving.bench --adapters 1,8,64,256 --requests 96 --compare-peft \\
        --json bench-out/sweep.json
    .venv/bin/python -m benchmarks.serving.bench --gpu --adapters 1,8,64 --requests 256 --compare-peft  # CUDA
    .venv/bin/python -m benchmarks.serving.bench --gpu --workload steady --adapters 0,1,8,64 --rank 16,8 \\
        --popularity uniform,power --concurrency 64,256 --repeats 3 --peft-check 16   # issue 21's bench
    .venv/bin/python -m benchmarks.serving.bench --model-shape smol135 --adapters 1,8,32 --prompt-len 32:128 \\
        --output-len 32:64 --peer vllm --peer-python /opt/vllm-cpu --json bench-out/vs-vllm.json

Beyond `loraplex bench`: --model-shape builds a realistic random-weight model (no hub), and --peer
runs the same requests through another server from its own environment (docs/benchmarks/cpu-vs-vllm.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.model_shape import MODEL_SHAPES, build_model_shape
from benchmarks.peers.peer import PeerConfigError, add_peer_arguments, check_peer_arguments, peer_runner
from server.bench.cli import DESCRIPTION, add_bench_arguments, config_from_args, report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    p.add_argument("--model-shape", choices=tuple(MODEL_SHAPES), default=None,
                   help="build this model shape with random weights under --work-dir (instead of --model)")
    add_peer_arguments(p)
    return p


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from dataclasses import replace

    from server.bench.artifacts import write_json
    from server.bench.client import BenchClientError
    from server.bench.model_setup import resolve_model
    from server.bench.runner import BenchConfigError, run_bench
    from server.bench.workload import WorkloadError

    args = build_parser().parse_args(argv)
    json_path = Path(args.json)
    try:
        if args.model_shape and args.model:
            raise BenchConfigError("--model-shape and --model are alternatives: give one")
        python = check_peer_arguments(args)
        cfg = config_from_args(args)
        if python is not None:  # the same KV pool on both sides: a smaller one preempts sooner
            cfg = replace(cfg, kv_cache_bytes=args.peer_kv_gib << 30)
        if args.model_shape:
            log(f"building the {args.model_shape} model shape (random weights)")
            model_dir = build_model_shape(args.model_shape, Path(args.work_dir) / "models" / args.model_shape)
            cfg = replace(cfg, model_dir=str(model_dir), model_label=f"{args.model_shape} shape (random weights)")
        peer, run_peer = (None, None) if python is None else peer_runner(cfg, args, python,
                                                                         resolve_model(cfg, log)[0], log)
        doc = run_bench(cfg, json_path, log=log, after_point=run_peer)
        if peer is not None:
            doc["peer"] = peer
            write_json(doc, json_path)
    except (BenchConfigError, PeerConfigError, WorkloadError, BenchClientError, ValueError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    report(doc, args, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
