"""One bench run: for each adapter count, the same seeded workload through
loraplex (HTTP or in-process engine) and, when asked, the transformers + peft
baseline, in that order and never at the same time."""
from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from server.bench.metrics import agreement, output_digests, ratio, summarize
from server.engine.cpu_threads import CpuThreadsError, parse_cpu_threads, resolve_cpu_threads
from server.bench.workload import (BenchRequest, WorkloadConfig, adapter_name, adapters_used, generate_workload,
                                   tenants_used)

TARGETS = ("http", "engine")
WORKLOADS = ("mixed", "prefix")  # generate_workload; generate_conversations, cache off and on (server.bench.prefix)


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
    rank: int = 8
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
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.adapter_counts or any(n < 0 for n in self.adapter_counts):
            raise BenchConfigError(f"--adapters needs counts >= 0, got {self.adapter_counts}")
        if self.target not in TARGETS:
            raise BenchConfigError(f"--target must be one of {TARGETS}, got {self.target!r}")
        if self.rank < 1:
            raise BenchConfigError(f"--rank must be >= 1, got {self.rank}")
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
        if self.workload_type not in WORKLOADS:
            raise BenchConfigError(f"--workload must be one of {WORKLOADS}, got {self.workload_type!r}")
        if self.repeats < 1:
            raise BenchConfigError(f"--repeats must be >= 1, got {self.repeats}")
        if self.workload_type == "prefix" and self.repeats != 1:
            raise BenchConfigError("--repeats applies to the mixed workload (the prefix workload runs once)")
        if self.workload_type == "prefix" and (self.target != "engine" or self.compare_peft):
            raise BenchConfigError("--workload prefix runs the in-process engine with its prefix cache off and on: "
                                   "use --target engine, without --compare-peft")
        # Validates the workload fields once, before any model is built.
        self.workload(max(self.adapter_counts), 512)

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


def environment(cfg: BenchConfig) -> dict:
    import peft
    import transformers

    gpu = torch.cuda.get_device_name(0) if cfg.device.startswith("cuda") and torch.cuda.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_threads": cfg.threads(), "affinity_cores": len(os.sched_getaffinity(0)),
            "kv_cache_bytes": cfg.kv_cache_bytes,
            "device_name": gpu or f"CPU ({os.cpu_count()} cores)",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def kv_cache_blocks(cfg: BenchConfig, model_dir: Path) -> int | None:
    """cfg.kv_cache_bytes as whole blocks of this model at the bench's dtype; None: the engine's default."""
    if cfg.kv_cache_bytes is None:
        return None
    from server.engine.config import EngineConfig, ModelConfig
    from server.engine.kv_cache import kv_bytes_per_block

    per_block = kv_bytes_per_block(ModelConfig.from_dir(model_dir), EngineConfig.block_size, getattr(torch, cfg.dtype))
    return max(1, cfg.kv_cache_bytes // per_block)


def _serve_args(cfg: BenchConfig, n_used: int, kv_blocks: int | None = None) -> list[str]:
    cap = 32 if cfg.device.startswith("cuda") else 128
    max_loras = cfg.max_loras or max(1, min(n_used, cap))
    kv = ["--kv-cache-blocks", str(kv_blocks)] if kv_blocks is not None else []
    return ["--device", cfg.device.split(":")[0], "--dtype", cfg.dtype, "--max-loras", str(max_loras),
            "--max-lora-rank", str(cfg.rank), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), *kv, "--cpu-threads", str(cfg.threads())]


def _run_http(cfg: BenchConfig, model_dir: Path, reqs: list[BenchRequest], named: dict[str, Path],
              n_used: int, log: Callable[[str], None]):
    from server.bench import client
    from server.bench.server_proc import ServerProcess, provision

    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="serve-", dir=work))
    try:
        with ServerProcess(data_dir, work / "logs" / f"serve-{len(named)}-adapters.log", model_dir=model_dir,
                           serve_args=_serve_args(cfg, n_used, kv_cache_blocks(cfg, model_dir))) as srv:
            owners = {r.adapter_name: r.tenant for r in reqs if r.adapter_name is not None}
            keys, base = provision(srv.url, srv.admin_token, tenants_used(reqs),
                                   {name: (owners[name], path) for name, path in named.items()})
            log(f"  server up at {srv.url}, {len(keys)} tenants, {len(named)} adapters uploaded")
            asyncio.run(client.warmup(srv.url, reqs, keys, base))
            return asyncio.run(client.drive(srv.url, reqs, keys, base))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _run_engine(cfg: BenchConfig, model_dir: Path, reqs: list[BenchRequest], named: dict[str, Path], n_used: int):
    from server.bench.engine_target import EngineTarget

    cap = 32 if cfg.device.startswith("cuda") else 128
    target = EngineTarget(model_dir, named, device=cfg.device, dtype=cfg.dtype,
                          max_loras=cfg.max_loras or max(1, min(n_used, cap)), max_lora_rank=cfg.rank,
                          max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          kv_cache_blocks=kv_cache_blocks(cfg, model_dir), cpu_threads=cfg.threads())
    target.warmup(reqs)
    records = target.run(reqs)
    del target
    return records


def _run_baseline(cfg: BenchConfig, model_dir: Path, reqs: list[BenchRequest], named: dict[str, Path]):
    from server.bench.baseline import BaselineConfig, PeftBaseline

    base = PeftBaseline(model_dir, named, BaselineConfig(cfg.device, cfg.dtype, cfg.baseline_max_batch,
                                                         threads=cfg.threads()))
    base.warmup(reqs)
    records = base.run(reqs)
    del base
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return records


def point_adapters(cfg: BenchConfig, model_dir: Path, used: list[int]) -> dict[str, Path]:
    """Adapter name -> its synthetic PEFT directory (made once, in the bench's dtype), for each index in use."""
    from server.bench.synth_adapters import ensure_adapters

    dirs = ensure_adapters(model_dir, Path(cfg.work_dir) / "adapters", used, r=cfg.rank, dtype=getattr(torch, cfg.dtype))
    return {adapter_name(i): dirs[i] for i in used}


def run_point(cfg: BenchConfig, model_dir: Path, n: int, log: Callable[[str], None]) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = generate_workload(cfg.workload(n, vocab))
    used = adapters_used(reqs)
    named = point_adapters(cfg, model_dir, used)
    log(f"[{n} adapters] {len(reqs)} requests over {len(used)} adapters in use, "
        f"{sum(r.max_tokens for r in reqs)} output tokens")
    t = time.perf_counter()
    # A busy machine skews whichever side ran while it was busy: the load average says so.
    load = {"loraplex": {"before": os.getloadavg()}}
    if cfg.target == "http":
        records = _run_http(cfg, model_dir, reqs, named, len(used), log)
    else:
        records = _run_engine(cfg, model_dir, reqs, named, len(used))
    load["loraplex"]["after"] = os.getloadavg()
    point = {"num_adapters": n, "adapters_in_use": len(used), "target": cfg.target, "cpu_threads": cfg.threads(),
             "load_avg": load, "loraplex": summarize(records, cfg.ttft_slo_s), "baseline": None}
    if cfg.target == "http":
        point["loraplex_output_digests"] = output_digests(records)
    log(f"  loraplex ({cfg.target}) done in {time.perf_counter() - t:.1f}s")
    if cfg.compare_peft:
        t = time.perf_counter()
        load["baseline"] = {"before": os.getloadavg()}
        base_records = _run_baseline(cfg, model_dir, reqs, named)
        point["baseline"] = summarize(base_records, cfg.ttft_slo_s)
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


def resolve_model(cfg: BenchConfig, log: Callable[[str], None]) -> tuple[Path, str]:
    if cfg.model_dir:
        return Path(cfg.model_dir), Path(cfg.model_dir).name
    if cfg.gpu:
        from server.bench.gpu_model import make_llama3_8b_shaped

        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        layers = cfg.gpu_layers
        log(f"building a Llama-3-8B-shaped random model ({layers or 32} layers) in {shm}")
        out = make_llama3_8b_shaped(shm / f"loraplex-llama3-8b-shaped-{layers or 32}l",
                                    dtype=getattr(torch, cfg.dtype), num_layers=layers)
        return out, f"Llama-3-8B-shaped ({layers or 32} layers, random)"
    from server.demo import ensure_demo

    return ensure_demo(Path(cfg.work_dir) / "demo").model_dir, "demo model (Llama, 4 layers, hidden 128)"


def run_bench(cfg: BenchConfig, json_path: Path | None = None, log: Callable[[str], None] = print,
              after_point: Callable[[dict], None] | None = None) -> dict:
    """The sweep, cfg.repeats times; after_point(point) runs another system on a point right after
    loraplex (and PEFT) did (scripts/bench.py's peer), adding its results to the point."""
    if cfg.workload_type == "prefix":
        from server.bench.prefix import run_prefix_bench

        return run_prefix_bench(cfg, json_path, log)
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
            point = run_point(cfg, model_dir, n, log)
            if after_point is not None:
                after_point(point)
            rounds[n].append(point)
            doc["points"] = [combine_rounds(rounds[m]) for m in counts if rounds[m]]
            ratios = {str(p["num_adapters"]): p.get("throughput_ratio_vs_peft") for p in doc["points"]}
            doc["throughput_ratio_vs_peft_by_adapters"] = ratios
            # The headline (the minimum interface's key): the ratio at the largest adapter count run.
            doc["throughput_ratio_vs_peft"] = ratios[str(max(p["num_adapters"] for p in doc["points"]))]
            doc["throughput_vs_fewest_adapters"] = scaling_vs_fewest({m: v for m, v in rounds.items() if v})
            if json_path is not None:
                from server.bench.report import write_json

                write_json(doc, json_path)  # after every point, so a long sweep keeps what it has
    return doc
