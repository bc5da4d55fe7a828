"""The fleet benchmark's adapters: a thousand distinct PEFT adapters from a few weight sets.

Writing and parsing a thousand safetensors files would take longer than the run on a loaded 2-core
machine, so each rank gets `bases` real PEFT directories (server.bench.synth_adapters) and adapter i
is base (i mod bases) of its rank with its LoRA scaling multiplied by a factor of its own: every
adapter has different effective weights (no registry or cache may share two of them), and each load
parses its base's bytes afresh, as a load from the registry does. The source is the engine's
`adapter_source` (adapters.host_tier.Fetch), so the host tier loads, evicts and reloads them by its
byte budget as it would from Redis.
"""
from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from adapters.format import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter, ModelShape, load_adapter_bytes
from server.bench.synth_adapters import write_adapter

RANKS = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class FleetAdapter:
    rank: int
    base: int       # which of the rank's weight sets
    factor: float   # its scaling's multiplier: what makes it distinct


def draw_fleet(n: int, seed: int, ranks: tuple[int, ...] = RANKS, bases: int = 2) -> dict[int, FleetAdapter]:
    """Adapter index -> its rank (uniform over `ranks`), weight set and factor; deterministic."""
    rng = random.Random(f"{seed}:fleet-ranks")
    return {i: FleetAdapter(rng.choice(ranks), i % bases, 0.5 + (i % 997) / 997) for i in range(n)}


class FleetSource:
    """version id (server.bench.workload.adapter_name of an index) -> a parsed adapter, on loader threads."""

    def __init__(self, model_dir: Path, shape: ModelShape, max_lora_rank: int, adapters: dict[str, FleetAdapter],
                 bases: int, seed: int) -> None:
        self.shape, self.max_lora_rank = shape, max_lora_rank
        self.adapters = adapters
        self.blobs: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for r in sorted({a.rank for a in adapters.values()}):
                for b in range(bases):
                    d = write_adapter(model_dir, Path(tmp) / f"r{r}-{b}", r=r, seed=seed * 1000 + r * 10 + b)
                    self.blobs[(r, b)] = ((d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes())

    def __call__(self, version: str) -> LoraAdapter:
        spec = self.adapters[version]
        config, weights = self.blobs[(spec.rank, spec.base)]
        adapter = load_adapter_bytes(config, weights, self.shape, self.max_lora_rank)
        scaled = {k: replace(w, scaling=w.scaling * spec.factor) for k, w in adapter.weights.items()}
        return replace(adapter, weights=MappingProxyType(scaled))

    def bytes_of(self, version: str) -> int:
        """Host bytes of the version once parsed (float32 A and B)."""
        spec = self.adapters[version]
        return len(self.blobs[(spec.rank, spec.base)][1])


def same_rank_pool(fleet: dict[int, FleetAdapter], n: int, ranks: tuple[int, ...] = RANKS
                   ) -> tuple[dict[int, FleetAdapter], dict[int, int]]:
    """A pool of n adapters (indices after the fleet's) covering `ranks` in turn, and the map from each
    fleet adapter to the pool's adapter of its rank (by index): the same trace over n adapters then
    does the same LoRA work per request, so the only difference from the fleet is how many adapters."""
    first = max(fleet) + 1
    pool = {first + j: FleetAdapter(ranks[j % len(ranks)], j % 2, 1.0) for j in range(n)}
    by_rank: dict[int, list[int]] = {}
    for idx, spec in pool.items():
        by_rank.setdefault(spec.rank, []).append(idx)
    if missing := {a.rank for a in fleet.values()} - set(by_rank):
        raise ValueError(f"a pool of {n} adapters cannot cover ranks {sorted(missing)}: give at least {len(ranks)}")
    return pool, {i: by_rank[a.rank][i % len(by_rank[a.rank])] for i, a in fleet.items()}
