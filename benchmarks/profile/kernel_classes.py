"""Device kernels of profiled steps: per kernel name and per class (LoRA shrink and expand, attention,
GEMM, elementwise/norm/rotary, other), device time and launches per step.

Pure functions over (kernel name, device microseconds) pairs, tested on a CPU; the GPU script takes the
pairs from torch.profiler's device events.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

LORA_SHRINK, LORA_EXPAND, ATTENTION, GEMM, ELEMENTWISE, OTHER = (
    "LoRA shrink", "LoRA expand", "attention", "GEMM", "elementwise/norm/rotary", "other")
CLASSES = (LORA_SHRINK, LORA_EXPAND, ATTENTION, GEMM, ELEMENTWISE, OTHER)

# Lower-case name fragments per class, tried in this order (the first class with a match wins): our
# Triton kernels by their function names (kernels/lora_triton_jit.py, attention_triton.py,
# attention_decode.py, the quantized linears), cuBLAS/cuBLASLt/CUTLASS GEMMs by theirs (nvjet on Hopper's
# cuBLAS 12.x, sm90_xmma, cutlass, ampere/sm80 *gemm*, splitKreduce), torch's own kernels by at::native's.
_FRAGMENTS = (
    (LORA_SHRINK, ("shrink",)),
    (LORA_EXPAND, ("expand",)),
    (ATTENTION, ("attention", "_decode_kernel", "combine_splits", "write_kv", "flash", "fmha")),
    (GEMM, ("gemm", "nvjet", "cublas", "cutlass", "xmma", "splitkreduce", "_linear_kernel")),
    (ELEMENTWISE, ("elementwise", "reduce", "norm", "rotary", "rope", "silu", "softmax", "index", "gather",
                   "scatter", "cat", "copy", "fill", "at::native")),
)


@dataclass(frozen=True)
class KernelRow:
    name: str
    kernel_class: str
    count_per_step: float
    us_per_step: float


@dataclass(frozen=True)
class ClassRow:
    kernel_class: str
    count_per_step: float
    us_per_step: float


def kernel_class(name: str) -> str:
    lower = name.lower()
    for cls, fragments in _FRAGMENTS:
        if any(f in lower for f in fragments):
            return cls
    return OTHER


def _totals(kernels: Iterable[tuple[str, float]], key) -> dict[str, tuple[int, float]]:
    count: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for name, t in kernels:
        count[key(name)] += 1
        us[key(name)] += t
    return {k: (count[k], us[k]) for k in count}


def kernel_table(kernels: Iterable[tuple[str, float]], steps: int, top: int = 15) -> list[KernelRow]:
    """The `top` kernel names by total device time, most first, as per-step launches and microseconds."""
    totals = _totals(kernels, lambda name: name)
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
    return [KernelRow(name, kernel_class(name), n / steps, us / steps) for name, (n, us) in ranked]


def class_table(kernels: Iterable[tuple[str, float]], steps: int) -> list[ClassRow]:
    """Every class in CLASSES order (zero where none ran), per step."""
    totals = _totals(kernels, kernel_class)
    return [ClassRow(cls, totals.get(cls, (0, 0.0))[0] / steps, totals.get(cls, (0, 0.0))[1] / steps)
            for cls in CLASSES]


def kernel_report(kernels: Iterable[tuple[str, float]], steps: int, top: int = 15) -> dict:
    """JSON-ready: device microseconds per step in all, the top kernels and the classes."""
    kernels = list(kernels)
    return {"steps": steps, "device_us_per_step": sum(t for _, t in kernels) / steps,
            "kernels": [asdict(r) for r in kernel_table(kernels, steps, top)],
            "classes": [asdict(r) for r in class_table(kernels, steps)]}
