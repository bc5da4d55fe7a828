#!/usr/bin/env python3
"""Benchmark multi-LoRA shrink+expand (and, with --attention, decode attention): Triton against torch.

Llama-3-8B-shaped projections, ranks 16/64, 1..512 tokens, 1/8/64 distinct
adapters. Per configuration: the median time per call, the bandwidth achieved
(bytes of adapter weights and activations the op must move, divided by time)
and that bandwidth as a share of the device's copy bandwidth, measured in the
same run with a large device-to-device copy. Slot buffers use the engine's
layout (B rank-major, server.engine.lora.slots).

On CUDA every configuration gets a pool of argument sets (inputs, slot buffers,
outputs) whose bytes touched exceed twice the L2 cache, so each call reads its
weights from HBM as in serving, where the rest of the step flushes L2; one call
per pool entry is captured into a CUDA graph and replayed
(`triton.testing.do_bench_cudagraph`), and the time is divided by the pool size:
launch overhead is out of the number, which is the device's time. (Timed one
launch at a time with CUDA events, every row of the first H100 run cost >= 0.12
ms: the host.) An op that cannot be captured (a host sync inside it) falls back
to CUDA events around the same rotation; the `timing` column says which. On a
CPU (--smoke) the wall clock times one argument set, as before.

--attention adds decode attention at Llama-3-8B's heads (32 over 8 kv heads of
128) for 1..256 sequences over 1k/4k-token contexts: the bytes are the K and V
it must read; few sequences run split-context (the `splits` column).

    python -m benchmarks.kernels.bench_kernels --json bench-out/kernels.json      # needs a CUDA GPU
    python -m benchmarks.kernels.bench_kernels --attention --json bench-out/kernels.json
    python -m benchmarks.kernels.bench_kernels --smoke [--attention]              # CPU, Triton interpreter

--split-k picks the Triton rows (issue 21's split-K shrink, kernels.metadata.shrink_splits):
`plan` (row `triton`: the split count the engine's launch plan picks, the `splits` column), `off` (row
`triton-nosplit`: the unsplit kernels, as before split-K), or a number (row `triton-split<N>`: forced).
--padded-decode runs the decode-shaped rows as the engine's graphed decode step does
(LoraBatch.padded_decode: every row gathered, a long run of one adapter included) instead of as an
eager step (runs longer than 4 tokens tiled), and adds the same Triton rows on the padded step's tiled
plan (`triton-tiled`, `triton-tiled-nosplit`, ...: rows sorted by slot into 16-row tiles of the
segmented kernels, kernels.sorted_tiles; kernels.metadata.PADDED_LORA_FORM picks the engine's form),
its table sized for max(--adapters) slots as an engine with that many slots sizes it (unused tiles are
programs that exit at once, and fewer programs' worth of split-K).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Llama-3-8B: name -> (in_features, output slice widths); hidden 4096, q 4096, kv 1024, mlp 14336.
PROJECTIONS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
# Same structure, sizes the Triton interpreter gets through in seconds.
SMOKE_PROJECTIONS = {"qkv": (64, (64, 16, 16)), "down": (96, (64,))}
# Attention heads (query, kv, head_dim): Llama-3-8B's, and a smoke-sized set.
ATTENTION_HEADS = (32, 8, 128)
SMOKE_ATTENTION_HEADS = (8, 2, 32)


@dataclass(frozen=True)
class Config:
    projection: str
    rank: int
    tokens: int
    adapters: int

    def __post_init__(self) -> None:
        if not 1 <= self.adapters <= self.tokens:
            raise ValueError(f"{self.adapters} distinct adapters need at least as many tokens, got {self.tokens}")

    @property
    def decode(self) -> bool:
        """Up to 64 tokens: one decode token per request; beyond: prefill runs, one per adapter."""
        return self.tokens <= 64


@dataclass(frozen=True)
class Result:
    projection: str
    rank: int
    tokens: int
    adapters: int
    shape: str  # decode | prefill
    impl: str  # torch | triton | triton-nosplit | triton-split<N> | triton-tiled... (--padded-decode)
    median_ms: float
    bytes_moved: int
    gb_per_s: float
    pct_of_copy: float
    max_rel_err: float  # max |y - y_torch| / (|y_torch| + 1) on the same inputs (0 for the reference)
    timing: str = "wall"  # cudagraph | events | wall (see the module's doc)
    pool: int = 1  # argument sets the timed calls rotate through
    splits: int = 1  # K splits of the shrink (Triton; the gathered one's, else the tiled one's), 1 = unsplit
    batch: str = "eager"  # eager (LoraBatch.build) | padded (LoraBatch.padded_decode, --padded-decode)


@dataclass(frozen=True)
class AttentionResult:
    seqs: int
    context: int
    impl: str  # triton | torch
    num_splits: int  # context splits of the Triton decode launch (1 = not split)
    median_ms: float
    bytes_moved: int
    gb_per_s: float
    pct_of_copy: float
    max_rel_err: float
    timing: str = "wall"
    pool: int = 1


# Above this many bytes of arguments a pool stops growing (H100 80 GB: room beside the copy buffers).
POOL_BUDGET_BYTES = 6 << 30
MAX_POOL = 256


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache (H100: 50 MiB); 0 on a CPU."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)


def pool_size(touched: int, allocated: int, l2: int) -> int:
    """Argument sets so that one pass touches more than twice L2, within POOL_BUDGET_BYTES."""
    if l2 == 0:
        return 1
    want = -(-2 * l2 // max(touched, 1)) + 1
    return max(1, min(want, POOL_BUDGET_BYTES // max(allocated, 1), MAX_POOL))


def time_per_call(calls: list, device: torch.device, warmup: int, iters: int) -> tuple[float, str]:
    """Median ms per call of a rotation through `calls` (see the module's doc), and how it was timed."""
    def rotation() -> None:
        for call in calls:
            call()

    if device.type == "cuda":
        import triton.testing

        # do_bench_cudagraph times on a fresh side stream that does not wait for the default one, where the
        # pool's generation and the checked call on argument set 0 may still be queued: the rotation then adds
        # to that set's y too, and the checked output read y0 + 2 delta. Seen on the H200 at gate_up rank 64,
        # 64 tokens x 64 adapters, padded: twice the next padded row's pool to generate, and a torch reference
        # that reads no host value (nothing drained the queue), so both Triton rows read 2.25 off it.
        torch.cuda.synchronize()
        try:
            ms = triton.testing.do_bench_cudagraph(rotation, rep=max(20, iters), return_mode="median")
            return ms / len(calls), "cudagraph"
        except RuntimeError as e:  # a host sync or allocation the capture refuses
            torch.cuda.synchronize()
            print(f"bench_kernels: graph capture failed ({str(e).splitlines()[0][:100]}); timing with events",
                  file=sys.stderr)
            return median_ms(rotation, device, warmup, iters) / len(calls), "events"
    return median_ms(rotation, device, warmup, iters) / len(calls), "wall"


def token_slots(cfg: Config) -> list[int]:
    if cfg.decode:  # requests of different adapters interleave, as a continuous batch does
        return [t % cfg.adapters for t in range(cfg.tokens)]
    per, extra = divmod(cfg.tokens, cfg.adapters)
    return [a for a in range(cfg.adapters) for _ in range(per + (a < extra))]


def bytes_moved(cfg: Config, hidden: int, widths: tuple[int, ...], elt: int) -> int:
    """What the op must read or write at least: each used adapter's A and B once, plus activations."""
    out = sum(widths)
    weights = cfg.adapters * cfg.rank * (len(widths) * hidden + out)
    activations = cfg.tokens * hidden + 2 * len(widths) * cfg.tokens * cfg.rank + 2 * cfg.tokens * out
    return (weights + activations) * elt


def median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s (a copy reads and writes nbytes each)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup=3, iters=iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def lora_batch(slots: list[int], num_slots: int, padded: bool, device, tiled: bool = False,
               table_slots: int = 0):
    """The step's LoraBatch: eager (LoraBatch.build), or a padded decode batch as the engine's graphed
    decode step builds it: every row gathered, or (tiled) rows sorted by slot into tiles (kernels.sorted_tiles)
    in a table sized for max(num_slots, table_slots) slots, as an engine of that many slots sizes it."""
    from kernels.metadata import LoraBatch

    if not padded:
        return LoraBatch.build(slots, device)
    if tiled:
        return LoraBatch.padded_tiled(slots, len(slots), max(num_slots, table_slots), device)
    rows = torch.tensor(slots, dtype=torch.int32)
    gather = torch.stack([torch.arange(len(slots), dtype=torch.int32), rows], 1).to(device)
    return LoraBatch.padded_decode(rows.to(device), gather, num_slots)


@dataclass(frozen=True)
class LoraImpl:
    apply: object  # the `lora` entry
    splits: int | None  # its splits argument (None: the launch plan's)
    tiled: bool = False  # a padded decode row's tiled plan instead of its gathered one


def lora_impls(split_k: list[str], padded: bool = False) -> dict[str, LoraImpl]:
    """impl name -> LoraImpl: torch, then a Triton row per --split-k value, and with --padded-decode the
    same again on the tiled plan (`triton-tiled...`; decode rows only)."""
    from kernels import lora_triton
    from server.engine.kernel_choice import torch_ops

    impls = {"torch": LoraImpl(torch_ops().lora.apply, None)}
    for tiled in (False, True) if padded else (False,):
        prefix = "triton-tiled" if tiled else "triton"
        for value in split_k:
            if value == "plan":
                impls[prefix] = LoraImpl(lora_triton.lora_apply, None, tiled)
            elif value == "off":
                impls[f"{prefix}-nosplit"] = LoraImpl(lora_triton.lora_apply, 1, tiled)
            else:
                impls[f"{prefix}-split{value}"] = LoraImpl(lora_triton.lora_apply, int(value), tiled)
    return impls


def run_config(cfg: Config, hidden: int, widths: tuple[int, ...], device, dtype, copy_gbps, warmup, iters,
               impls: dict, padded: bool = False, table_slots: int = 0) -> list[Result]:
    """table_slots: the engine's slot count that a padded step's tiled table is sized for (lora_batch)."""
    from kernels import lora_triton

    g = torch.Generator(device=device).manual_seed(0)
    # One slot per adapter in use: the pool's rotation, not the slot stride, decides what L2 holds.
    num_slots = cfg.adapters
    nslices = len(widths)
    slots = token_slots(cfg)
    padded = padded and cfg.decode
    batches = {tiled: lora_batch(slots, num_slots, padded, device, tiled, table_slots)
               for tiled in ((False, True) if padded else (False,))}
    elt = torch.finfo(dtype).bits // 8
    moved = bytes_moved(cfg, hidden, widths, elt)
    allocated = elt * (cfg.tokens * hidden + num_slots * cfg.rank * (nslices * hidden + sum(widths))
                       + cfg.tokens * (nslices * cfg.rank + 2 * sum(widths)))

    def arguments():
        x = torch.randn(cfg.tokens, hidden, device=device, generator=g).to(dtype)
        lora_a = (torch.randn(num_slots, nslices, cfg.rank, hidden, device=device, generator=g)
                  / hidden**0.5).to(dtype).transpose(0, 1)  # [S, L, R, in] stored slot-major, as the engine's
        lora_b = tuple((torch.randn(num_slots, cfg.rank, n, device=device, generator=g) / cfg.rank**0.5).to(dtype)
                       .transpose(1, 2) for n in widths)  # [L, n, R] stored rank-major, as the engine's slots
        y0 = torch.randn(cfg.tokens, sum(widths), device=device, generator=g).to(dtype)
        return x, lora_a, lora_b, y0

    pool = [arguments() for _ in range(pool_size(moved, allocated, l2_bytes(device)))]
    scaling = torch.full((nslices, num_slots), 2.0, device=device)
    offsets = tuple(sum(widths[:i]) for i in range(nslices))

    outputs = {}
    results = []
    for impl, chosen in impls.items():
        if chosen.tiled not in batches:
            continue  # a tiled row of an eager (prefill-shaped) configuration: no such plan
        lora, splits, batch = chosen.apply, chosen.splits, batches[chosen.tiled]
        kw = {} if impl == "torch" else {"splits": splits}
        calls = []
        for n, (x, lora_a, lora_b, y0) in enumerate(pool):
            h = torch.empty(nslices, cfg.tokens, cfg.rank, device=device, dtype=dtype)
            y = y0.clone()
            if n == 0:  # outside the timed graph: the split partials are allocated here, once
                lora(x, lora_a, lora_b, scaling, offsets, batch, h, y, **kw)
                outputs[impl] = y.float()
            calls.append(lambda lora=lora, kw=kw, x=x, a=lora_a, b=lora_b, h=h, y=y:
                         lora(x, a, b, scaling, offsets, batch, h, y, **kw))
        ms, timing = time_per_call(calls, device, warmup, iters)
        gbps = moved / (ms * 1e-3) / 1e9
        ref = outputs["torch"]
        err = ((outputs[impl] - ref).abs() / (ref.abs() + 1)).max().item()
        split = None if impl == "torch" else (lora_triton.split_k(batch, pool[0][1], splits)
                                              or lora_triton.split_k(batch, pool[0][1], splits, "tiled"))
        results.append(Result(cfg.projection, cfg.rank, cfg.tokens, cfg.adapters,
                              "decode" if cfg.decode else "prefill", impl, ms, moved, gbps,
                              100 * gbps / copy_gbps, err, timing, len(pool), split.splits if split else 1,
                              "padded" if padded else "eager"))
        del calls
    return results


def run_attention(seqs: int, context: int, heads: tuple[int, int, int], device, dtype, copy_gbps, warmup, iters,
                  ops) -> list[AttentionResult]:
    """One decode step of `seqs` sequences, each over `context` cached tokens (block size 16)."""
    from kernels.attention_triton import step_plan
    from kernels.metadata import AttentionBatch

    hq, hkv, d = heads
    g = torch.Generator(device=device).manual_seed(0)
    per_seq = -(-(context + 1) // 16)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    batch = AttentionBatch.build(tables, [context] * seqs, [1] * seqs, 16, device)
    splits = step_plan(batch, 1, hkv, device).num_splits
    elt = torch.finfo(dtype).bits // 8
    moved = 2 * seqs * (context + 1) * hkv * d * elt
    allocated = 2 * seqs * per_seq * 16 * hkv * d * elt + 2 * seqs * hq * d * elt

    def arguments():
        k_cache = torch.randn(seqs * per_seq, 16, hkv, d, device=device, generator=g).to(dtype)
        v_cache = torch.randn(seqs * per_seq, 16, hkv, d, device=device, generator=g).to(dtype)
        return torch.randn(seqs, hq, d, device=device, generator=g).to(dtype), k_cache, v_cache

    pool = [arguments() for _ in range(pool_size(moved, allocated, l2_bytes(device)))]
    outputs, results = {}, []
    for impl in ("torch", "triton"):
        calls = []
        for n, (q, k_cache, v_cache) in enumerate(pool):
            out = torch.empty_like(q)
            if n == 0:
                ops[impl].paged_attention(q, k_cache, v_cache, batch, d ** -0.5, out)
                outputs[impl] = out.float()
            calls.append(lambda impl=impl, q=q, k=k_cache, v=v_cache, out=out:
                         ops[impl].paged_attention(q, k, v, batch, d ** -0.5, out))
        ms, timing = time_per_call(calls, device, warmup, iters)
        gbps = moved / (ms * 1e-3) / 1e9
        ref = outputs["torch"]
        err = ((outputs[impl] - ref).abs() / (ref.abs() + 1)).max().item()
        results.append(AttentionResult(seqs, context, impl, splits if impl == "triton" else 1, ms, moved, gbps,
                                       100 * gbps / copy_gbps, err, timing, len(pool)))
        del calls
    return results


def print_attention(results: list[AttentionResult]) -> None:
    print(f"\n{'seqs':>5} {'ctx':>6} {'impl':6} {'splits':>6} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'err':>8} "
          f"{'timing':>9} {'pool':>4}")
    for r in results:
        print(f"{r.seqs:>5} {r.context:>6} {r.impl:6} {r.num_splits:>6} {r.median_ms:>9.4f} {r.gb_per_s:>8.1f} "
              f"{r.pct_of_copy:>6.1f} {r.max_rel_err:>8.2g} {r.timing:>9} {r.pool:>4}")


def print_table(results: list[Result], copy_gbps: float, device_name: str) -> None:
    print(f"device: {device_name}; device-to-device copy: {copy_gbps:.0f} GB/s")
    head = (f"{'proj':8} {'rank':>4} {'tok':>4} {'adap':>4} {'shape':8} {'impl':20} {'split':>5} {'ms':>9} "
            f"{'GB/s':>8} {'%copy':>6} {'x torch':>7} {'err':>8} {'timing':>9} {'pool':>4}")
    print(head)
    print("-" * len(head))
    torch_ms = {(r.projection, r.rank, r.tokens, r.adapters): r.median_ms for r in results if r.impl == "torch"}
    for r in results:
        speedup = torch_ms[(r.projection, r.rank, r.tokens, r.adapters)] / r.median_ms
        print(f"{r.projection:8} {r.rank:>4} {r.tokens:>4} {r.adapters:>4} {r.shape:8} {r.impl:20} {r.splits:>5} "
              f"{r.median_ms:>9.4f} {r.gb_per_s:>8.1f} {r.pct_of_copy:>6.1f} {speedup:>7.2f} {r.max_rel_err:>8.2g} "
              f"{r.timing:>9} {r.pool:>4}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; on a machine without CUDA runs the Triton interpreter")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--projections", nargs="+", choices=sorted(PROJECTIONS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512])
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--attention", action="store_true", help="also time decode attention")
    parser.add_argument("--seqs", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--split-k", nargs="+", default=["plan", "off"], metavar="plan|off|N",
                        help="Triton rows: plan (the launch plan's split count), off (unsplit), N (forced: 2, 4 "
                             "or 8); default: plan off")
    parser.add_argument("--padded-decode", action="store_true",
                        help="decode-shaped rows as the engine's graphed decode step (every row gathered), "
                             "plus triton-tiled rows on its tiled plan; default off (an eager step's plan)")
    parser.add_argument("--warmup", type=int, help="untimed calls per config (default 10; 1 with --smoke)")
    parser.add_argument("--iters", type=int, help="timed calls per config (default 50; 3 with --smoke)")
    args = parser.parse_args(argv)
    for value in args.split_k:
        if value not in ("plan", "off", "2", "4", "8"):
            parser.error(f"--split-k takes plan, off, 2, 4 or 8, got {value!r}")

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_kernels: no CUDA GPU here, so there is nothing meaningful to time. "
              "Run it on a GPU machine, or pass --smoke for a tiny correctness run under the "
              "Triton interpreter.", file=sys.stderr)
        return 2
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is imported
    from server.engine.kernel_choice import torch_ops, triton_ops

    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    shapes = SMOKE_PROJECTIONS if args.smoke else PROJECTIONS
    names = [p for p in (args.projections or shapes) if p in shapes]
    ranks, tokens, adapters = args.ranks, args.tokens, args.adapters
    warmup, iters = (1, 3) if args.smoke else (10, 50)
    if args.smoke:
        ranks, tokens, adapters = [16], [1, 8, 80], [1, 8]
    warmup = warmup if args.warmup is None else args.warmup
    iters = iters if args.iters is None else args.iters
    if warmup < 0 or iters < 1:
        parser.error(f"--warmup takes 0 or more and --iters 1 or more, got {warmup} and {iters}")
    copy_gbps = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20), iters=20 if cuda else 5)
    ops = {"torch": torch_ops(), "triton": triton_ops()}
    impls = lora_impls(args.split_k, args.padded_decode)

    results: list[Result] = []
    for name in names:
        hidden, widths = shapes[name]
        for rank in ranks:
            for t in tokens:
                for a in adapters:
                    if a > t:
                        continue
                    results += run_config(Config(name, rank, t, a), hidden, widths, device, dtype,
                                          copy_gbps, warmup, iters, impls, args.padded_decode, max(adapters))
    attention: list[AttentionResult] = []
    if args.attention:
        heads, seqs, contexts = ATTENTION_HEADS, args.seqs, args.contexts
        if args.smoke:
            heads, seqs, contexts = SMOKE_ATTENTION_HEADS, [1, 4], [600]
        for n in seqs:
            for c in contexts:
                attention += run_attention(n, c, heads, device, dtype, copy_gbps, warmup, iters, ops)
    device_name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter; times are not meaningful)"
    print_table(results, copy_gbps, device_name)
    if attention:
        print_attention(attention)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": device_name, "dtype": args.dtype, "copy_gb_per_s": copy_gbps, "smoke": args.smoke,
            "l2_bytes": l2_bytes(device),
            "results": [asdict(r) for r in results], "attention": [asdict(r) for r in attention],
        }, indent=1))
    # A few ulps: each computes and rounds its own h, then sums in its own order.
    bad = [r for r in [*results, *attention] if r.max_rel_err > 8 * torch.finfo(dtype).eps]
    if bad:
        print(f"bench_kernels: {len(bad)} Triton result(s) differ from the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
