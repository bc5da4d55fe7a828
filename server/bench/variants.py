"""Engine variants of one bench run: `--quantization none,int8` x `--kv-cache-dtype auto,fp8_e4m3`.

Every variant serves the same trace at each point, one after another, so their speeds come from the
same minutes of a shared machine; the first (the first value of each flag) is the reference, and each
other's throughput is reported as a ratio to it, paired within a round like the other systems'
ratios (server.bench.rounds). A single variant is just passed through to the server or engine.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

NO_QUANTIZATION = "none"
AUTO_KV = "auto"


@dataclass(frozen=True)
class EngineVariant:
    quantization: str = NO_QUANTIZATION  # --quantization's value, or none
    kv_cache_dtype: str = AUTO_KV

    @property
    def label(self) -> str:
        return f"weights={self.quantization},kv={self.kv_cache_dtype}"

    def serve_flags(self) -> list[str]:
        """`loraplex serve` flags; the defaults are left out, so a checkout without a flag still runs."""
        flags = [] if self.quantization == NO_QUANTIZATION else ["--quantization", self.quantization]
        return flags + ([] if self.kv_cache_dtype == AUTO_KV else ["--kv-cache-dtype", self.kv_cache_dtype])

    def engine_kwargs(self) -> dict:
        """EngineConfig fields, likewise only where they differ from the defaults."""
        out = {} if self.quantization == NO_QUANTIZATION else {"quantization": self.quantization}
        return out | ({} if self.kv_cache_dtype == AUTO_KV else {"kv_cache_dtype": self.kv_cache_dtype})


def engine_variants(quantizations: tuple[str, ...], kv_cache_dtypes: tuple[str, ...]) -> list[EngineVariant]:
    """Every combination, the given order kept (the first of each is the reference); ValueError for a
    value the engine does not serve or a repeated one."""
    from server.engine.config import check_quantization_name
    from server.engine.kv_cache_dtype import check_kv_cache_dtype_name

    if not quantizations or not kv_cache_dtypes:
        raise ValueError("--quantization and --kv-cache-dtype need at least one value each")
    if len(set(quantizations)) < len(quantizations) or len(set(kv_cache_dtypes)) < len(kv_cache_dtypes):
        raise ValueError(f"repeated values in --quantization {quantizations} or --kv-cache-dtype {kv_cache_dtypes}")
    for q in quantizations:
        check_quantization_name(None if q == NO_QUANTIZATION else q)
    for kv in kv_cache_dtypes:
        check_kv_cache_dtype_name(kv)
    return [EngineVariant(q, kv) for q, kv in itertools.product(quantizations, kv_cache_dtypes)]


def variant_order(variants: list[EngineVariant], round_index: int) -> list[EngineVariant]:
    """The order variants run in a round: as given in even rounds, reversed in odd ones, so that no
    variant always runs first on a machine that is warming up or getting busier."""
    return variants if round_index % 2 == 0 else list(reversed(variants))


def throughput_ratios(runs: dict[str, dict], reference: str) -> dict[str, float | None]:
    """Each variant's output tok/s over the reference's (runs: label -> metrics.summarize result)."""
    ref = runs[reference]["throughput_tok_s"]
    return {label: (s["throughput_tok_s"] / ref if ref else None) for label, s in runs.items() if label != reference}


def median_ratios(rounds: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Per variant, the median of its rounds' paired ratios."""
    out = {}
    for label in rounds[0]:
        values = [r[label] for r in rounds if r.get(label) is not None]
        out[label] = statistics.median(values) if values else None
    return out
