"""What a bench run is given: the model directory, its synthetic adapters, the KV pool and the
adapter slots. Shared by every workload (mixed, prefix, steady) and by the peer runner."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch

from server.bench.workload import adapter_name


class SlotError(ValueError):
    """Fewer adapter slots than adapters outside a churn case: the run would time adapter loads."""


def resolve_model(cfg, log: Callable[[str], None]) -> tuple[Path, str]:
    """cfg: a BenchConfig. (model directory, label for the report)."""
    if cfg.model_dir:
        return Path(cfg.model_dir), Path(cfg.model_dir).name
    if cfg.workload_type == "real":
        from server.bench.real_workload import real_model_dir

        return real_model_dir(Path(cfg.work_dir), log), "SmolLM2-135M-Instruct (real weights)"
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


def point_requests(cfg, model_dir: Path, n: int) -> list:
    """The seeded trace of a mixed or real point over n adapters (server.bench.workload.BenchRequest)."""
    import json

    from server.bench.workload import generate_workload

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = generate_workload(cfg.workload(n, vocab))
    if cfg.workload_type == "real":
        from server.bench.real_workload import real_prompts

        reqs = real_prompts(reqs, model_dir, cfg.seed)
    return reqs


def point_adapters(cfg, model_dir: Path, used: list[int], rank: int | None = None) -> dict[str, Path]:
    """Adapter name -> its synthetic PEFT directory (made once, in the bench's dtype), for each index
    in use, at `rank` (default: the config's first rank); with --workload real, the shipped demo adapters."""
    from server.bench.synth_adapters import ensure_adapters

    if cfg.workload_type == "real":
        from server.bench.real_workload import real_adapters

        return real_adapters(used)

    dirs = ensure_adapters(model_dir, Path(cfg.work_dir) / "adapters", used, r=rank or cfg.rank,
                           dtype=getattr(torch, cfg.dtype))
    return {adapter_name(i): dirs[i] for i in used}


def kv_cache_blocks(cfg, model_dir: Path) -> int | None:
    """cfg.kv_cache_bytes as whole blocks of this model at the bench's dtype; None: the engine's default."""
    if cfg.kv_cache_bytes is None:
        return None
    from server.engine.config import CacheConfig, ModelConfig
    from server.engine.kv_cache import kv_bytes_per_block

    per_block = kv_bytes_per_block(ModelConfig.from_dir(model_dir), CacheConfig.block_size, getattr(torch, cfg.dtype))
    return max(1, cfg.kv_cache_bytes // per_block)


def lora_slots(max_loras: int | None, n_used: int, churn: bool = False) -> int:
    """Adapter slots for a run over n_used adapters: one per adapter (all preloaded in the warm-up,
    outside the timed window), or the asked count. Fewer slots than adapters is churn, which a run
    must ask for by name: timing adapter loads under another label is what made the first H100
    "64 adapters" point 63 adapters cycling through 32 slots."""
    slots = max_loras or max(1, n_used)
    if slots < n_used and not churn:
        raise SlotError(f"--max-loras {slots} is fewer slots than the {n_used} adapters in use: the run would "
                        f"time adapter loads; drop --max-loras (one slot per adapter) or run it as churn "
                        f"(--churn ADAPTERS:SLOTS)")
    return slots


def serve_args(cfg, n_used: int, kv_blocks: int | None = None, *, slots: int | None = None,
               rank: int | None = None, variant=None) -> list[str]:
    """`loraplex serve` flags for a bench run (cfg: a BenchConfig) over n_used adapters; variant: the
    server.bench.variants.EngineVariant to serve (cfg's first when None)."""
    max_loras = slots or lora_slots(cfg.max_loras, n_used)
    kv = ["--kv-cache-blocks", str(kv_blocks)] if kv_blocks is not None else []
    eager = ["--enforce-eager"] if cfg.enforce_eager else []
    return ["--device", cfg.device.split(":")[0], "--dtype", cfg.dtype, "--max-loras", str(max_loras),
            "--max-lora-rank", str(rank or cfg.rank), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), *kv, *eager,
            *(["--engine-process", cfg.engine_process] if cfg.engine_process else []),
            "--cpu-threads", str(cfg.threads()), *(variant or cfg.variants[0]).serve_flags()]


def engine_kwargs(cfg, model_dir: Path, slots: int, rank: int | None = None, variant=None) -> dict:
    """EngineConfig fields for a loraplex engine run of the bench (EngineTarget's engine_kwargs); variant
    as in serve_args."""
    return dict(device=cfg.device, dtype=cfg.dtype, max_loras=slots, max_lora_rank=rank or cfg.rank,
                max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                kv_cache_blocks=kv_cache_blocks(cfg, model_dir), cpu_threads=cfg.threads(),
                enforce_eager=cfg.enforce_eager,
                **(variant or cfg.variants[0]).engine_kwargs())
