"""The byte bounds printed beside each adapter point: what LoRA must cost at least, from the model's
shape, the adapters' ranks and targeted projections and how many distinct adapters share a step.

Decode is a memory-bound read of every weight once per step. Adapters add their A and B matrices
for each distinct adapter in the step, so the best a multi-LoRA step can do is the base step plus
those extra bytes at the device's bandwidth:

    bound = t_base / (t_base + extra_bytes / bandwidth)

with t_base the measured base step (concurrency / base decode tok/s in steady state). Without a
measured base step or a bandwidth, the bytes-only figure base_bytes / (base_bytes + extra_bytes) is
the same formula for a base step at its own HBM floor: a reference, not a ceiling, since a base
step slower than its floor (host-bound, compute-bound) pays relatively less for the same bytes. Example (issue 21): a rank-16 adapter on all seven
projections of Llama-3-8B is 83.9 MB; 64 distinct ones in a step read 5.4 GB more, about 1.6 ms at
an H100's 3350 GB/s beside a graphed base step of 9-12 ms: a bound of about 0.85-0.88x.
"""
from __future__ import annotations

from server.bench.synth_adapters import SEVEN, projection_shapes

# Vendor HBM bandwidth, GB/s, by a substring of torch.cuda.get_device_name(); the first match wins.
KNOWN_BANDWIDTH_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
                        ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0))
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def device_bandwidth_gbps(device_name: str | None) -> float | None:
    """The HBM bandwidth of a known GPU (H100 SXM: 3350 GB/s); None for others and CPUs."""
    for key, gbps in KNOWN_BANDWIDTH_GBPS:
        if device_name and key in device_name:
            return gbps
    return None


def adapter_bytes(cfg: dict, rank: int, dtype_bytes: int, targets: tuple[str, ...] = SEVEN) -> int:
    """One adapter's A [r, in] and B [out, r] over every layer and targeted projection."""
    shapes = projection_shapes(cfg)
    per_layer = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    return cfg["num_hidden_layers"] * per_layer * dtype_bytes


def base_weight_bytes(cfg: dict, dtype_bytes: int) -> int:
    """What one decode step reads of the base model: every projection, the norms and the lm_head
    (the embedding table only gives the step's rows, left out)."""
    h = cfg["hidden_size"]
    per_layer = sum(i * o for i, o in projection_shapes(cfg).values()) + 2 * h
    return (cfg["num_hidden_layers"] * per_layer + h + cfg["vocab_size"] * h) * dtype_bytes


def expected_distinct(num_adapters: int, in_step: int, alpha: float = 1.0) -> float:
    """Expected distinct adapters among in_step requests, each adapter = floor(n * u), u ~ power(alpha)
    (P(adapter = i) = ((i+1)/n)^alpha - (i/n)^alpha; alpha = 1 is uniform)."""
    n = num_adapters
    if n == 0 or in_step == 0:
        return 0.0
    probs = [((i + 1) / n) ** alpha - (i / n) ** alpha for i in range(n)]
    return sum(1.0 - (1.0 - p) ** in_step for p in probs)


def bound(base_bytes: int, extra_bytes: float, base_step_s: float | None = None,
          bandwidth_gbps: float | None = None) -> dict:
    """The best adapter/base throughput ratio the extra bytes allow (see the module's doc)."""
    out = {"extra_bytes": extra_bytes, "base_bytes": base_bytes,
           "bytes_bound": base_bytes / (base_bytes + extra_bytes), "time_bound": None, "extra_s": None}
    if base_step_s is not None and bandwidth_gbps:
        out["extra_s"] = extra_bytes / (bandwidth_gbps * 1e9)
        out["time_bound"] = base_step_s / (base_step_s + out["extra_s"])
    out["bound"] = out["time_bound"] if out["time_bound"] is not None else out["bytes_bound"]
    return out


def weight_read_floor_s(base_bytes: int, bandwidth_gbps: float) -> float:
    """Batch-1 decode's floor: one read of the base weights per token at the device's bandwidth."""
    return base_bytes / (bandwidth_gbps * 1e9)
