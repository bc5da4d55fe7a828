"""One bench run: for each adapter count, the same seeded workload through
loraplex (HTTP or in-process engine) and, when asked, the transformers + peft
baseline, in that order and never at the same time."""
from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from server.bench.environment import environment, machine_state
from server.bench.metrics import agreement, output_digests, ratio, summarize
from server.bench.variants import (AUTO_KV, NO_QUANTIZATION, EngineVariant, engine_variants, throughput_ratios,
                                   variant_order)
from server.bench.model_setup import (engine_kwargs, kv_cache_blocks, lora_slots, point_adapters, point_requests,
                                      resolve_model, serve_args)
from server.config import ENGINE_PROCESSES, ServerConfig
from server.engine.cpu_threads import CpuThreadsError, parse_cpu_threads, resolve_cpu_threads
from server.bench.workload import BenchRequest, WorkloadConfig, adapters_used, check_same_trace, trace_totals

TARGETS = ("http", "engine")
# generate_workload as a timed burst or schedule; generate_conversations, cache off and on (server.bench.prefix);
# fixed concurrency for a steady window, base against adapter cases (server.bench.steady); the schema
# suite's validity and the cost of constraints on throughput (server.bench.structured);
# real: the mixed trace on the real default model with real text and the demo adapters (server.bench.real_workload).
WORKLOADS = ("mixed", "prefix", "steady", "structured", "real")
POPULARITY = ("uniform", "power", "distinct")


class BenchConfigError(ValueError):
    """Bench options that cannot work together; the message says which."""


@dataclass(frozen=True)
class BenchConfig:
    adapter_counts: tuple[int, ...] = (8,)
    num_requests: int | None = 64
    duration_s: float | None = None
    rate: float = math.inf
    cv: float = 1.0
    alpha: float = 1.0
    prompt_len: tuple[int, int] = (8, 64)
    output_len: tuple[int, int] = (16, 64)
    num_tenants: int = 4
    base_share: float = 0.0
    seed: int = 0
    ranks: tuple[int, ...] = (16,)        # adapter ranks; mixed and prefix use the first, steady runs each
    target: str = "http"
    compare_peft: bool = False
    model_dir: str | None = None          # None: the demo model (or the 8B shape with gpu)
    gpu: bool = False                     # Llama-3-8B-shaped random model on CUDA, bf16
    gpu_layers: int | None = None         # fewer layers of the 8B widths, for a smoke test
    device: str = "cpu"
    dtype: str = "float32"
    max_loras: int | None = None          # None: adapters in use, capped at 128 (CPU) / 32 (GPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    ttft_slo_s: float = 6.0
    baseline_max_batch: int = 32
    cpu_threads: str | int = "auto"       # every side on a CPU device gets this many torch threads
    kv_cache_bytes: int | None = None     # loraplex's KV pool (a peer's, matched); None: the engine's default
    work_dir: str = "bench-out"
    model_label: str = ""
    workload_type: str = "mixed"
    shared_prefix_len: int = 512          # prefix workload: each tenant's system prompt, in tokens
    turns: int = 3                        # prefix workload: turns per conversation, each resending history
    turn_gap_s: float = 1.0               # prefix workload: seconds between a conversation's turns
    repeats: int = 1                      # rounds of the sweep, order alternating (server.bench.rounds)
    # steady workload (server.bench.steady)
    concurrency: tuple[int, ...] = (64,)  # requests kept in flight, refilled as they finish
    steady_s: float = 60.0                # the measured window, after the warm-up
    warmup_s: float = 10.0                # at full concurrency before the window opens
    popularity: tuple[str, ...] = ("uniform",)  # adapter popularity cases: uniform, power(power_alpha), distinct
    power_alpha: float = 0.3
    churn: tuple[int, int] | None = None  # (adapters, slots): a case with more adapters than slots
    peft_check: int = 0                   # per adapter case, this many trace requests checked on token ids
    device_bandwidth_gbps: float | None = None  # HBM GB/s for the bounds; None: known devices' (bandwidth.py)
    enforce_eager: bool = False           # no decode CUDA graphs (DeviceConfig.enforce_eager; serve --enforce-eager)
    # Engine variants (server.bench.variants): each combination serves every point; the first is the reference.
    quantization: tuple[str, ...] = (NO_QUANTIZATION,)
    kv_cache_dtype: tuple[str, ...] = (AUTO_KV,)
    # http target: the server's --engine-process; None: the server's default (resolved, so the JSON says which)
    engine_process: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.adapter_counts or any(n < 0 for n in self.adapter_counts):
            raise BenchConfigError(f"--adapters needs counts >= 0, got {self.adapter_counts}")
        if self.target not in TARGETS:
            raise BenchConfigError(f"--target must be one of {TARGETS}, got {self.target!r}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise BenchConfigError(f"--rank needs ranks >= 1, got {self.ranks}")
        if len(self.ranks) > 1 and self.workload_type != "steady":
            raise BenchConfigError("several --rank values are a steady-workload sweep; the others take one rank")
        if self.ttft_slo_s <= 0:
            raise BenchConfigError(f"--ttft-slo must be > 0, got {self.ttft_slo_s}")
        try:
            object.__setattr__(self, "cpu_threads", parse_cpu_threads(self.cpu_threads))
        except CpuThreadsError as e:
            raise BenchConfigError(f"--cpu-threads: {e}") from None
        if self.cpu_threads is None:
            raise BenchConfigError("--cpu-threads: both sides need a recorded count, auto or N")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise BenchConfigError(f"the KV pool needs a positive size, got {self.kv_cache_bytes} bytes")
        if self.gpu and not torch.cuda.is_available():
            raise BenchConfigError("--gpu needs a CUDA device; none is visible to torch")
        if self.target != "http" and self.engine_process is not None:
            raise BenchConfigError("--engine-process is the HTTP server's: refused with --target engine")
        if self.target == "http":
            mode = self.engine_process or ServerConfig.engine_process
            if mode not in ENGINE_PROCESSES:
                raise BenchConfigError(f"--engine-process must be one of {ENGINE_PROCESSES}, got {mode!r}")
            object.__setattr__(self, "engine_process", mode)
        if self.workload_type not in WORKLOADS:
            raise BenchConfigError(f"--workload must be one of {WORKLOADS}, got {self.workload_type!r}")
        if self.repeats < 1:
            raise BenchConfigError(f"--repeats must be >= 1, got {self.repeats}")
        if self.workload_type == "prefix" and self.repeats != 1:
            raise BenchConfigError("--repeats applies to the mixed workload (the prefix workload runs once)")
        if self.workload_type == "prefix" and (self.target != "engine" or self.compare_peft):
            raise BenchConfigError("--workload prefix runs the in-process engine with its prefix cache off and on: "
                                   "use --target engine, without --compare-peft")
        self._check_steady()
        try:
            variants = self.variants
        except ValueError as e:
            raise BenchConfigError(str(e)) from None
        if len(variants) > 1 and (self.workload_type != "mixed" or self.compare_peft):
            raise BenchConfigError("several --quantization / --kv-cache-dtype values are compared on the mixed "
                                   "workload, without --compare-peft; the other workloads take one of each")
        # Validates the workload fields once, before any model is built.
        self.workload(max(self.adapter_counts), 512)

    def _check_steady(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchConfigError(f"--concurrency needs counts >= 1, got {self.concurrency}")
        if not self.steady_s > 0 or not self.warmup_s >= 0:
            raise BenchConfigError(f"--steady-duration must be > 0 and --warmup >= 0, got "
                                   f"{self.steady_s} and {self.warmup_s}")
        if not self.popularity or any(p not in POPULARITY for p in self.popularity):
            raise BenchConfigError(f"--popularity must name some of {POPULARITY}, got {self.popularity}")
        if not self.power_alpha > 0:
            raise BenchConfigError(f"--power-alpha must be > 0, got {self.power_alpha}")
        if self.churn is not None and not 1 <= self.churn[1] < self.churn[0]:
            raise BenchConfigError(f"--churn ADAPTERS:SLOTS needs 1 <= SLOTS < ADAPTERS, got {self.churn}")
        if self.peft_check < 0:
            raise BenchConfigError(f"--peft-check must be >= 0, got {self.peft_check}")
        if self.device_bandwidth_gbps is not None and not self.device_bandwidth_gbps > 0:
            raise BenchConfigError(f"--device-bandwidth-gbps must be > 0, got {self.device_bandwidth_gbps}")
        steady_only = {"--concurrency": self.concurrency != (64,), "--churn": self.churn is not None,
                       "--peft-check": self.peft_check > 0, "--popularity": self.popularity != ("uniform",),
                       "--steady-duration": self.steady_s != 60.0, "--warmup": self.warmup_s != 10.0,
                       "--power-alpha": self.power_alpha != 0.3,
                       "--device-bandwidth-gbps": self.device_bandwidth_gbps is not None}
        if self.workload_type == "structured":
            steady_only.pop("--concurrency")  # the structured workload's burst size
            if self.num_requests is None or math.isfinite(self.rate):
                raise BenchConfigError("--workload structured sends one request per schema: --requests sets how "
                                       "many; --rate and --duration do not apply")
            if self.target != "http" or self.compare_peft:
                raise BenchConfigError("--workload structured drives a server over HTTP: use --target http, "
                                       "without --compare-peft")
        if self.workload_type != "steady":
            for flag, given in steady_only.items():
                if given:
                    raise BenchConfigError(f"{flag} applies to --workload steady")
        elif self.num_requests is None or math.isfinite(self.rate):
            raise BenchConfigError("--workload steady sends from the trace at fixed concurrency: --requests sets "
                                   "its length; --rate and --duration do not apply")
        elif self.compare_peft:
            raise BenchConfigError("--workload steady checks peft on token ids (--peft-check N), not by speed: "
                                   "drop --compare-peft")

    @property
    def variants(self) -> list[EngineVariant]:
        """The engine variants, the reference first."""
        return engine_variants(self.quantization, self.kv_cache_dtype)

    @property
    def rank(self) -> int:
        """The rank of the mixed and prefix workloads' adapters (the first asked)."""
        return self.ranks[0]

    def threads(self) -> int:
        """The one thread count loraplex, the PEFT baseline and a peer all get, resolved here."""
        return resolve_cpu_threads(self.cpu_threads)

    def workload(self, num_adapters: int, vocab: int) -> WorkloadConfig:
        return WorkloadConfig(
            num_adapters=num_adapters, num_requests=self.num_requests, duration_s=self.duration_s,
            rate=self.rate, cv=self.cv, alpha=self.alpha, prompt_len=self.prompt_len, output_len=self.output_len,
            num_tenants=max(1, min(self.num_tenants, num_adapters or 1)), base_share=self.base_share,
            # ids 0-2 are special in the demo and Llama 2; below 512 is ordinary text in Llama 3 and Qwen2.
            token_range=(3, min(vocab, 512)), seed=self.seed,
            **(dict(shared_prefix_len=self.shared_prefix_len, turns=self.turns, turn_gap_s=self.turn_gap_s)
               if self.workload_type == "prefix" else {}))


def _run_http(cfg: BenchConfig, model_dir: Path, reqs: list[BenchRequest], named: dict[str, Path],
              n_used: int, log: Callable[[str], None], variant: EngineVariant):
    from server.bench import client
    from server.bench.server_proc import bench_server

    args = serve_args(cfg, n_used, kv_cache_blocks(cfg, model_dir), variant=variant)
    with bench_server(cfg.work_dir, model_dir, args, reqs, named, log) as (url, keys, base):
        return asyncio.run(client.drive(url, reqs, keys, base)), None


def _run_engine(cfg: BenchConfig, model_dir: Path, reqs: list[BenchRequest], named: dict[str, Path], n_used: int,
                variant: EngineVariant):
    from server.bench.engine_target import EngineTarget

    target = EngineTarget(model_dir, named, **engine_kwargs(cfg, model_dir, lora_slots(cfg.max_loras, n_used),
                                                            variant=variant))
    target.warmup(reqs)
    records = target.run(reqs)
    outputs = target.outputs
    target.engine.shutdown()
    del target
    return records, outputs


def _run_baseline(cfg: BenchConfig, model_dir: Path, reqs: list[BenchRequest], named: dict[str, Path]):
    from server.bench.baseline import BaselineConfig, PeftBaseline

    base = PeftBaseline(model_dir, named, BaselineConfig(cfg.device, cfg.dtype, cfg.baseline_max_batch,
                                                         threads=cfg.threads()))
    base.warmup(reqs)
    records = base.run(reqs)
    outputs = base.outputs
    del base
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return records, outputs


def _baseline_model(cfg: BenchConfig, model_dir: Path) -> tuple[Path, str]:
    """The oracle's checkpoint and what it holds: with --quantization int8 the weights loraplex serves,
    dequantized (the baseline is then exact against loraplex, not against the float model)."""
    if cfg.variants[0].quantization != "int8":
        return model_dir, "float"
    from server.bench.quantized_peer_checkpoint import write_int8_reference

    out = Path(cfg.work_dir) / "models" / f"{Path(model_dir).name}-int8-reference"
    return write_int8_reference(model_dir, out), "int8-dequantized"


def run_point(cfg: BenchConfig, model_dir: Path, n: int, log: Callable[[str], None], round_index: int = 0) -> dict:
    reqs = point_requests(cfg, model_dir, n)
    used = adapters_used(reqs)
    named = point_adapters(cfg, model_dir, used)
    log(f"[{n} adapters] {len(reqs)} requests over {len(used)} adapters in use, "
        f"{sum(r.max_tokens for r in reqs)} output tokens")
    t = time.perf_counter()
    # A busy machine skews whichever side ran while it was busy: the load average says so.
    start = machine_state(log)
    load = {"loraplex": {"before": start["load_avg"]}}
    variants = cfg.variants
    runs, variant_loads = {}, {}
    for variant in variant_order(variants, round_index):
        before = os.getloadavg()
        if cfg.target == "http":
            records, ids = _run_http(cfg, model_dir, reqs, named, len(used), log, variant)
        else:
            records, ids = _run_engine(cfg, model_dir, reqs, named, len(used), variant)
        runs[variant.label] = (records, ids)
        variant_loads[variant.label] = {"before": before, "after": os.getloadavg()}
        if len(variants) > 1:
            log(f"  {variant.label}: {summarize(records, cfg.ttft_slo_s)['throughput_tok_s']:.1f} out tok/s")
    records, token_ids = runs[variants[0].label]
    load["loraplex"]["after"] = os.getloadavg()
    point = {"num_adapters": n, "adapters_in_use": len(used), "target": cfg.target, "cpu_threads": cfg.threads(),
             "trace": trace_totals(reqs), "gpu_clocks": start["gpu_clocks"], "load_avg": load,
             "loraplex": summarize(records, cfg.ttft_slo_s), "baseline": None}
    if cfg.target == "http":
        point["loraplex_output_digests"] = output_digests(records)
    if len(variants) > 1:
        summaries = {v.label: summarize(runs[v.label][0], cfg.ttft_slo_s) for v in variants}
        point["variants"] = [{"label": v.label, "quantization": v.quantization, "kv_cache_dtype": v.kv_cache_dtype,
                              "load_avg": variant_loads[v.label], "loraplex": summaries[v.label]} for v in variants]
        point["variant_throughput_ratios"] = throughput_ratios(summaries, variants[0].label)
    log(f"  loraplex ({cfg.target}) done in {time.perf_counter() - t:.1f}s")
    if cfg.compare_peft:
        t = time.perf_counter()
        load["baseline"] = {"before": os.getloadavg()}
        oracle_dir, point["baseline_weights"] = _baseline_model(cfg, model_dir)
        base_records, base_ids = _run_baseline(cfg, oracle_dir, reqs, named)
        point["baseline"] = summarize(base_records, cfg.ttft_slo_s)
        if token_ids is not None:  # the engine target's token ids; over HTTP only the text is seen
            from server.bench.token_check import compare_token_ids

            point["token_ids_vs_peft"] = compare_token_ids(reqs, token_ids, base_ids)
        if any(r.text for r in base_records):
            point["baseline_output_digests"] = output_digests(base_records)
            point["outputs_vs_peft"] = agreement(point.get("loraplex_output_digests"), point["baseline_output_digests"])
        load["baseline"]["after"] = os.getloadavg()
        log(f"  transformers + peft done in {time.perf_counter() - t:.1f}s")
        lp, bl = point["loraplex"], point["baseline"]
        point["throughput_ratio_vs_peft"] = ratio(lp["throughput_tok_s"], bl["throughput_tok_s"])
        point["request_throughput_ratio_vs_peft"] = ratio(lp["throughput_req_s"], bl["throughput_req_s"])
        point["ttft_p50_ratio_peft_over_loraplex"] = ratio(bl["ttft_s"]["p50"], lp["ttft_s"]["p50"])
    return point


def run_bench(cfg: BenchConfig, json_path: Path | None = None, log: Callable[[str], None] = print,
              after_point: Callable[[dict], None] | None = None) -> dict:
    """The sweep, cfg.repeats times; after_point(point) runs another system on a point right after
    loraplex (and PEFT) did (benchmarks/serving/bench.py's peer), adding its results to the point."""
    if cfg.workload_type == "prefix":
        from server.bench.prefix import run_prefix_bench

        return run_prefix_bench(cfg, json_path, log)
    if cfg.workload_type == "steady":
        from server.bench.steady import run_steady_bench

        return run_steady_bench(cfg, json_path, log)
    if cfg.workload_type == "structured":
        from server.bench.structured import run_structured_bench

        return run_structured_bench(cfg, json_path, log)
    from server.bench.rounds import combine_rounds, round_order, scaling_vs_fewest

    model_dir, label = resolve_model(cfg, log)
    cfg_dict = asdict(cfg)
    cfg_dict.pop("extra")
    cfg_dict["model_label"] = cfg.model_label or label
    cfg_dict["rate"] = None if math.isinf(cfg.rate) else cfg.rate  # JSON has no infinity
    doc = {"config": cfg_dict, "environment": environment(cfg), "points": []}
    counts = tuple(dict.fromkeys(cfg.adapter_counts))
    rounds: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(cfg.repeats):
        if cfg.repeats > 1:
            log(f"round {r + 1}/{cfg.repeats}: adapters {', '.join(map(str, round_order(counts, r)))}")
        for n in round_order(counts, r):
            point = run_point(cfg, model_dir, n, log, r)
            if after_point is not None:
                after_point(point)
            rounds[n].append(point)
            # One trace for every point: the base run is the same requests with no adapter.
            check_same_trace([p["trace"] for ps in rounds.values() for p in ps])
            doc["points"] = [combine_rounds(rounds[m]) for m in counts if rounds[m]]
            ratios = {str(p["num_adapters"]): p.get("throughput_ratio_vs_peft") for p in doc["points"]}
            doc["throughput_ratio_vs_peft_by_adapters"] = ratios
            # The headline (the minimum interface's key): the ratio at the largest adapter count run.
            doc["throughput_ratio_vs_peft"] = ratios[str(max(p["num_adapters"] for p in doc["points"]))]
            doc["throughput_vs_fewest_adapters"] = scaling_vs_fewest({m: v for m, v in rounds.items() if v})
            if json_path is not None:
                from server.bench.artifacts import write_json

                write_json(doc, json_path)  # after every point, so a long sweep keeps what it has
    return doc
