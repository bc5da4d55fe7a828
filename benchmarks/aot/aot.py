"""Ahead-of-time compilation of captured Triton launches for CUDA, with no GPU and no driver.

`capture()` records each launch where Triton would run it (`JITFunction.run`,
or the interpreter's `run`), without running anything, so a forward pass on
`meta` tensors yields every launch with its real arguments and grid.
`Specialiser` then applies the binder the JIT itself uses (integer values of
1, 16-divisibility, 16-byte pointer alignment, i32/i64 by value) for a CUDA
target, giving the exact (signature, constexprs, attrs, options) the JIT would
compile and its cache key, and `compile_variant()` compiles that to a cubin
(the wheel ships ptxas) and reads shared memory, registers and spills.
The limits a launch must respect are CUDA's; Triton reads them from the
driver at launch, so they are written here.
"""
from __future__ import annotations

import importlib
import io
import os
import pkgutil
import re
import subprocess
import tempfile
import time
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

# Dynamic shared memory per block with the opt-in attribute (CUDA C Programming Guide, compute capabilities).
SHARED_LIMITS = {90: 232448, 80: 166912}  # 227 KB on sm_90 (H100/H200), 163 KB on sm_80 (A100)
MAX_THREADS = 1024  # threads per block
GRID_LIMITS = (2**31 - 1, 65535, 65535)  # grid x, y, z
# Kernel parameters that stride over token rows or KV blocks: a row index times one of these passes
# 2^31 elements at ~75k tokens (Llama-3-8B gate_up: 28672 columns), so the product must be 64-bit.
ROW_STRIDES = frozenset(("stride_xt", "stride_ot", "stride_ht", "stride_yt", "stride_qt", "stride_kt", "stride_vt",
                         "stride_kcb", "stride_vcb"))
_TTIR_OP = re.compile(r"\s*(%[\w.]+) = ([\w.]+) (.*?) loc\(")
# Ops that carry a value along (its bits, or a widened copy) without being the product itself.
_CARRY = frozenset(("tt.splat", "tt.broadcast", "tt.expand_dims", "arith.extsi", "arith.select", "arith.addi",
                    "arith.muli"))


@dataclass(frozen=True)
class Launch:
    kernel: Any  # JITFunction (or InterpretedFunction under TRITON_INTERPRET)
    args: tuple
    kwargs: dict
    grid: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass(frozen=True)
class Variant:
    """One compilation the JIT would do: picklable, so compiles can run in worker processes."""

    module: str
    name: str
    key: str  # the JIT's cache key: equal keys are one compiled kernel
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def tiles(self) -> dict[str, Any]:
        """The constexpr parameters by name (tile sizes, flags), without the specialised-to-1 integers."""
        names = list(self.signature)
        return {names[path[0]]: value for path, value in self.constexprs.items()
                if self.signature[names[path[0]]] == "constexpr" and names[path[0]].isupper()}


@dataclass
class Compiled:
    variant: Variant
    capability: int
    seconds: float
    shared: int = 0
    num_warps: int = 0
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads, from ptxas
    errors: list[str] = field(default_factory=list)


@contextmanager
def capture() -> Iterator[list[Launch]]:
    """Record every Triton launch in the block instead of running it."""
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        grid = grid(dict(zip(self.arg_names, args))) if callable(grid) else grid
        launches.append(Launch(self, args, dict(kwargs), tuple(int(g) for g in grid)))

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    for cls in originals:
        cls.run = record
    try:
        yield launches
    finally:
        for cls, run in originals.items():
            cls.run = run


class Specialiser:
    """What `JITFunction.run` would hand to the compiler for a launch on a GPU of a given capability.

    Binders are built once per (kernel, capability), as the JIT caches them per device.
    """

    def __init__(self) -> None:
        self._binders: dict[tuple[int, int], tuple[Any, Any]] = {}

    def _bind(self, launch: Launch, capability: int):
        fn = launch.kernel
        if isinstance(fn, InterpretedFunction):
            raise RuntimeError("specialising needs real JIT functions: run without TRITON_INTERPRET=1")
        cached = self._binders.get((id(fn), capability))
        if cached is None:
            backend = make_backend(GPUTarget("cuda", capability, 32))
            cached = (backend, create_function_from_signature(fn.signature, fn.params, backend))
            self._binders[(id(fn), capability)] = cached
        backend, binder = cached
        kwargs = dict(launch.kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as JITFunction.run passes them
            if hasattr(knobs.compilation, knob):  # absent from older Triton (3.6 has no fpsan_*)
                kwargs[knob] = getattr(knobs.compilation, knob)
        bound, specialization, options = binder(*launch.args, **kwargs)
        return backend, kwargs, bound, specialization, options

    def key(self, launch: Launch, capability: int) -> tuple[str, str, int]:
        """(kernel, the JIT's cache key, capability): equal keys are one compiled kernel."""
        _, _, _, specialization, options = self._bind(launch, capability)
        return launch.name, compute_cache_key({}, specialization, options), capability

    def variant(self, launch: Launch, capability: int) -> Variant:
        backend, kwargs, bound, specialization, options = self._bind(launch, capability)
        key = compute_cache_key({}, specialization, options)
        options, signature, constexprs, attrs = launch.kernel._pack_args(backend, kwargs, bound, specialization,
                                                                         options)
        return Variant(launch.kernel.fn.__module__, launch.name, key, signature, constexprs, attrs,
                       options.__dict__)


def grid_errors(launch: Launch) -> list[str]:
    """CUDA's grid limits; an empty dimension is an error too (a launch with no work is a bug)."""
    if len(launch.grid) > 3:
        return [f"{launch.name}: grid {launch.grid} has more than 3 dimensions"]
    return [f"{launch.name}: grid {launch.grid} dimension {axis} is {g}, outside [1, {limit}]"
            for axis, (g, limit) in enumerate(zip(launch.grid, GRID_LIMITS)) if not 1 <= g <= limit]


def narrow_row_products(ttir: str, params: set[str] | frozenset[str] = ROW_STRIDES) -> list[str]:
    """The TTIR products (arith.muli) that involve a row stride parameter, or a value derived from one,
    computed in 32 bits: each is a token or block offset that overflows past 2^31 elements."""
    derived = {"%" + p for p in params}
    narrow = []
    for line in ttir.splitlines():
        m = _TTIR_OP.match(line)
        if m is None:
            continue
        result, op, rest = m.groups()
        operands, _, types = rest.partition(" : ")
        if not derived & set(re.findall(r"%[\w.]+", operands)) or op not in _CARRY:
            continue
        derived.add(result)
        if op == "arith.muli" and not re.search(r"i64>?$", types.strip()):
            narrow.append(line.strip())
    return narrow


def all_kernels(package: str = "kernels") -> dict[str, str]:
    """Every @triton.jit kernel (a name ending in `_kernel`) in the package: name -> module."""
    found = {}
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, (JITFunction, InterpretedFunction)) and obj.fn.__name__.endswith("_kernel"):
                found[obj.fn.__name__] = obj.fn.__module__
    return found


def unlaunched(launched: Iterable[str]) -> list[str]:
    """Kernels in kernels/ that no captured step launched: a check that never compiled them proves nothing."""
    return sorted(set(all_kernels()) - set(launched))


def compile_variant(variant: Variant, capability: int) -> Compiled:
    """Compile for sm_<capability> and check the per-block limits; never raises for a kernel's fault."""
    fn = getattr(importlib.import_module(variant.module), variant.name)
    start = time.perf_counter()
    result = Compiled(variant, capability, 0.0)
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    try:
        with redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, variant.signature, variant.constexprs, variant.attrs),
                                    target=GPUTarget("cuda", capability, 32), options=variant.options)
    except Exception as e:  # noqa: BLE001 - a compile error is this check's finding, reported per variant
        result.errors.append(f"{variant.name} sm_{capability}: compile error: {type(e).__name__}: {e}"[:2000])
        result.seconds = time.perf_counter() - start
        return result
    ptxas = log.getvalue() or _ptxas_log(kernel.asm["ptx"], capability)  # empty on a cache hit
    result.seconds = time.perf_counter() - start
    result.shared = kernel.metadata.shared
    result.num_warps = kernel.metadata.num_warps
    result.registers = max((int(r) for r in re.findall(r"Used (\d+) registers", ptxas)), default=0)
    result.spill_bytes = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas))
    limit = SHARED_LIMITS[capability]
    if result.shared > limit:
        result.errors.append(f"{variant.name} sm_{capability}: {result.shared} bytes of shared memory, "
                             f"over the {limit}-byte per-block limit")
    for line in narrow_row_products(kernel.asm["ttir"]):
        result.errors.append(f"{variant.name} sm_{capability}: a row offset is computed in 32 bits "
                             f"(overflows past 2^31 elements): {line[:200]}")
    if result.num_warps * 32 > MAX_THREADS:
        result.errors.append(f"{variant.name} sm_{capability}: {result.num_warps} warps, over {MAX_THREADS} threads")
    return result


def _ptxas_log(ptx: str, capability: int) -> str:
    """ptxas -v on the PTX: registers and spills when Triton's cache answered without running ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(capability).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", src + ".o"],
                              capture_output=True, text=True)
    return done.stderr
