#!/usr/bin/env python3
"""Compile every Triton kernel variant the engine can launch for sm_90 and sm_80, with no GPU.

For each engine shape (model widths x dtype x max_lora_rank) it runs the real
forward pass (server.engine.model) on `meta` tensors over decode (1, 8, 256
sequences), prefill, chunked-prefill, mixed and speculative verify steps at every rank class, and
every padded decode and verify context the engine captures as a CUDA graph (server.engine.decode_graphs),
captures each Triton launch with the specialisation the JIT would apply
(benchmarks.aot.aot), and compiles every distinct variant for both targets. It fails
(exit 1) on a compile error, shared memory over the per-block limit, more than
1024 threads, a grid dimension outside CUDA's limits, a kernel in kernels/
that no step launched, or a variant that engine warm-up (server.engine.warmup)
would not have compiled before serving. Registers and spills are reported.

    .venv/bin/python -m benchmarks.aot.aot_check                 # the default set (tests/kernels/test_kernels_aot.py)
    .venv/bin/python -m benchmarks.aot.aot_check --full          # fp16 too (the GPU runbook runs this)
    .venv/bin/python -m benchmarks.aot.aot_check --json out.json --models llama3-8b --dtypes bf16

The default set leaves out fp16, which shares every code path and tile size
with bf16 (only the element type differs), to stay under a minute on two cores.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.aot import aot
from benchmarks.aot.aot_shapes import DTYPES, MODELS, EngineShape, is_moe, meta_engine, meta_experts_step, scenarios
from server.engine.decode_graphs import PaddedDecode
from server.engine.kernel_choice import triton_ops
from server.engine.kv_cache_dtype import KV_CACHE_DTYPES
from server.engine.speculative_config import AUTO_DISABLE_BY_BATCH_SIZE
from server.engine.warmup import step_inputs, warmup_steps

TARGETS = (90, 80)
QUANTIZED_MATMULS = {"int8": "_int8_linear_kernel", "int4": "_int4_linear_kernel"}  # --quantization -> its kernel
EXPERT_KERNELS = {"_expert_shrink_kernel", "_expert_expand_kernel"}  # launched by MoE models only


def capture_shape(shape: EngineShape) -> tuple[dict[str, list[aot.Launch]], list[aot.Launch]]:
    """(scenario name -> launches, warm-up launches) of one engine shape's forward passes on meta (an MoE
    shape's: its experts' LoRA launches, aot_shapes.meta_experts_step)."""
    ops = triton_ops()
    if is_moe(shape):
        def run_experts(steps) -> list[aot.Launch]:
            with aot.capture() as launches:
                for step in steps:
                    meta_experts_step(shape, ops, step)
            return launches

        return ({name: run_experts(steps) for name, steps in scenarios(shape).items()},
                run_experts(warmup_steps(shape.max_lora_rank, shape.max_num_batched_tokens, shape.max_model_len,
                                         DTYPES[shape.dtype])))
    model, kv, scratch, page_table = meta_engine(shape)

    def run(steps) -> list[aot.Launch]:
        with aot.capture() as launches:
            for step in steps:
                ids, ctx, rows = step_inputs(step, ops=ops, block_size=shape.block_size, lora_scratch=scratch,
                                             device="meta", page_table=page_table)
                model.forward(ids, kv, ctx, rows)
        return launches

    by_scenario = {name: run(steps) for name, steps in scenarios(shape).items()}
    by_scenario["padded decode and verify"] = padded_launches(shape, model, kv, scratch, page_table, "gathered")
    by_scenario["padded decode and verify, tiled LoRA"] = padded_launches(shape, model, kv, scratch, page_table,
                                                                          "tiled")
    # The warm-up of an engine whose padded steps run the tiled plan: the gathered one's steps and one of
    # that plan, which launches nothing but its own (INDEXED) LoRA variants, so each form's warm-up is held
    # to its own padded launches.
    warm = run(warmup_steps(shape.max_lora_rank, shape.max_num_batched_tokens, shape.max_model_len,
                            DTYPES[shape.dtype], padded_form="tiled"))
    return by_scenario, warm


def padded_launches(shape: EngineShape, model, kv, scratch: torch.Tensor, page_table: torch.Tensor | None,
                    lora_form: str) -> list[aot.Launch]:
    """Every context the engine captures as a CUDA graph (server.engine.decode_graphs): decode buckets up
    to 256 rows and verify shapes of k + 1 = 2..5 tokens up to 31 rows (a GPU's speculation cut-off, less
    one), with and without LoRA and DoRA, run once each on meta, their LoRA on the `lora_form` plan
    (kernels.metadata.PADDED_LORA_FORM: both are checked, whichever the engine runs)."""
    entries = shape.max_loras if page_table is None else page_table.shape[0]
    rank_table = torch.zeros(entries, dtype=torch.int32, device="meta")
    padded = PaddedDecode(model, kv, triton_ops(), scratch, entries, 256, shape.max_model_len, shape.block_size,
                          torch.device("meta"), rank_table, None, page_table, (2, 3, 4, 5),
                          AUTO_DISABLE_BY_BATCH_SIZE["cuda"] - 1, lora_form)
    with aot.capture() as launches:
        for key in padded.contexts:
            padded.run(key)
    return launches


def capture_and_specialise(shape: EngineShape) -> tuple[dict, dict[str, int], list[str]]:
    """One engine shape's variants ({(kernel, key, capability): Variant}), launches per kernel, and errors."""
    by_scenario, warm = capture_shape(shape)
    spec = aot.Specialiser()
    targets = [cap for cap in TARGETS if shape.runs_on(cap)]
    warm_keys = {spec.key(w, cap) for w in warm for cap in targets}
    variants: dict[tuple, aot.Variant] = {}
    launches: dict[str, int] = {}
    errors: list[str] = []
    for name, captured in [*by_scenario.items(), ("warm-up", warm)]:
        for launch in captured:
            launches[launch.name] = launches.get(launch.name, 0) + 1
            errors += [f"{shape.label} {name}: {e}" for e in aot.grid_errors(launch)]
            for cap in targets:
                key = spec.key(launch, cap)
                if key not in variants:
                    variants[key] = spec.variant(launch, cap)
                if key not in warm_keys:
                    errors.append(f"{shape.label} {name}: {launch.name} variant {variants[key].tiles()} is not "
                                  f"compiled by warm-up: it would compile in the middle of serving")
    return variants, launches, sorted(set(errors))


def check(shapes: list[EngineShape], jobs: int, only: set[str] | None = None) -> dict:
    start = time.perf_counter()
    errors: list[str] = []
    variants: dict[tuple, aot.Variant] = {}
    launches_per_kernel: dict[str, int] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for found, launches, errs in pool.map(capture_and_specialise, shapes):
            for key, v in found.items():
                variants.setdefault(key, v)
            for name, n in launches.items():
                launches_per_kernel[name] = launches_per_kernel.get(name, 0) + n
            errors += errs
        captured = time.perf_counter() - start
        # Only an int8 (int4) shape launches the int8 (int4) matmul: a run without one does not miss it;
        not_asked = {kernel for quant, kernel in QUANTIZED_MATMULS.items()
                     if all(s.quantization != quant for s in shapes)}
        not_asked |= EXPERT_KERNELS if not any(is_moe(s) for s in shapes) else set()  # nor one without an MoE model
        errors += [f"kernel {name} was never launched by any step"
                   for name in aot.unlaunched(launches_per_kernel) if name not in not_asked]
        todo = sorted(((k, v) for k, v in variants.items() if only is None or k[0] in only),
                      key=lambda kv: (-_cost(kv[0][0]), kv[0]))  # slowest first
        results = list(pool.map(aot.compile_variant, [v for _, v in todo], [key[2] for key, _ in todo]))
    for r in results:
        errors += r.errors
    return report(results, launches_per_kernel, errors, shapes, captured, time.perf_counter() - start)


def _cost(kernel: str) -> int:
    """Rough compile cost, to start the slow compiles first and keep both workers busy to the end."""
    return 2 if "attention" in kernel or "decode" in kernel else 1


def report(results: list[aot.Compiled], launches: dict[str, int], errors: list[str], shapes, captured: float,
           seconds: float) -> dict:
    kernels: dict[str, dict] = {}
    for r in results:
        k = kernels.setdefault(r.variant.name, {"launches": launches.get(r.variant.name, 0)})
        t = k.setdefault(f"sm_{r.capability}", {"variants": 0, "max_shared": 0, "max_registers": 0,
                                                "spill_bytes": 0, "spilling_variants": 0, "compile_s": 0.0})
        t["variants"] += 1
        t["max_shared"] = max(t["max_shared"], r.shared)
        t["max_registers"] = max(t["max_registers"], r.registers)
        t["spill_bytes"] += r.spill_bytes
        t["spilling_variants"] += r.spill_bytes > 0
        t["compile_s"] = round(t["compile_s"] + r.seconds, 2)
    spills = [{"kernel": r.variant.name, "sm": r.capability, "spill_bytes": r.spill_bytes, "registers": r.registers,
               "tiles": r.variant.tiles()} for r in results if r.spill_bytes]
    return {"ok": not errors, "errors": errors, "kernels": kernels, "spills": spills,
            "shapes": [s.label for s in shapes], "compiled": len(results), "capture_s": round(captured, 1),
            "seconds": round(seconds, 1)}


def print_report(out: dict) -> None:
    print(f"{'kernel':28} {'launches':>8} " + " ".join(
        f"{'sm_' + str(c) + ' var':>10} {'smem KB':>8} {'regs':>5} {'spill B':>8}" for c in TARGETS))
    for name, k in sorted(out["kernels"].items()):
        cells = []
        for cap in TARGETS:
            t = k.get(f"sm_{cap}", {})
            cells.append(f"{t.get('variants', 0):>10} {t.get('max_shared', 0) / 1024:>8.1f} "
                         f"{t.get('max_registers', 0):>5} {t.get('spill_bytes', 0):>8}")
        print(f"{name:28} {k['launches']:>8} " + " ".join(cells))
    for s in out["spills"]:
        print(f"spill: {s['kernel']} sm_{s['sm']}: {s['spill_bytes']} bytes, {s['registers']} registers, "
              f"{s['tiles']}")
    print(f"{len(out['shapes'])} engine shapes, {out['compiled']} compilations, capture {out['capture_s']} s, "
          f"total {out['seconds']} s")
    for e in out["errors"]:
        print("FAIL:", e)
    print("AOT check passed" if out["ok"] else f"AOT check FAILED: {len(out['errors'])} problem(s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default: bf16 fp32 (all with --full)")
    p.add_argument("--full", action="store_true", help="every dtype")
    p.add_argument("--max-lora-ranks", nargs="+", type=int, default=[64, 512])
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                   help="KV pool dtypes (default auto); an e4m3 pool compiles for sm_90 only (refused below 8.9)")
    p.add_argument("--quantizations", nargs="+", default=["none", *QUANTIZED_MATMULS],
                   choices=["none", *QUANTIZED_MATMULS],
                   help="base weights (default none int8 int4): int8 and int4 each add each model and dtype at "
                        "the first --max-lora-ranks value, int8 lm_head included (kernels.int8_triton's and "
                        "kernels.int4_triton's launches depend on the projection shapes, not on the rank)")
    p.add_argument("--lora-page-rows", nargs="+", type=int, default=[16],
                   help="adapter memory paged by rank: each adds each model and dtype at the first "
                        "--max-lora-ranks value, read through a page table, in its own buffers and as "
                        "--unified-memory's views of one (default 16; 0: none)")
    p.add_argument("--compile-only", nargs="+", metavar="KERNEL", help="compile only these kernels' variants")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    dtypes = args.dtypes or (list(DTYPES) if args.full else ["bf16", "fp32"])
    shapes = [EngineShape(m, d, r, kv_cache_dtype=kv) for m in args.models for d in dtypes
              for r in args.max_lora_ranks for kv in args.kv_cache_dtypes] if "none" in args.quantizations else []
    # MoE models are served unquantized (server.engine.architectures).
    shapes += [EngineShape(m, d, args.max_lora_ranks[0], quantization=quant) for quant in QUANTIZED_MATMULS
               if quant in args.quantizations for m in args.models for d in dtypes
               if not is_moe(EngineShape(m, d, args.max_lora_ranks[0]))]
    # MoE models keep slots (server.engine.architectures): pages only for dense shapes; each also as
    # --unified-memory's strided views of one buffer (KV and pages alike: server.engine.unified_buffer).
    shapes += [EngineShape(m, d, args.max_lora_ranks[0], lora_page_rows=rows, unified_memory=unified)
               for rows in args.lora_page_rows if rows for m in args.models for d in dtypes for unified in (False, True)
               if not is_moe(EngineShape(m, d, args.max_lora_ranks[0]))]
    # A meta torch.cat imports torch._dynamo (2 s): once here, not once per forked worker.
    torch.cat([torch.empty(1, device="meta")] * 2)
    out = check(shapes, args.jobs, set(args.compile_only) if args.compile_only else None)
    print_report(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":  # @triton.jit must give real JIT functions here
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # the JIT's default is what we check
    sys.exit(main())
