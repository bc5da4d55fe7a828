"""Helpers shared by the kernel test files: bit-exact comparison and lowering
kernels to CUDA without a GPU."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the raw bits, so NaN sentinels compare equal to themselves."""
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def have_ptxas() -> bool:
    try:
        return triton.knobs.nvidia.ptxas is not None
    except Exception:  # no CUDA backend in this Triton build
        return False


def compile_for_cuda(kernel, dtype: str, pointer_types: dict[str, str], constexprs: dict) -> None:
    """Lower a kernel to a cubin for sm_90 (Hopper) without a GPU; raises if it cannot.

    Pointer arguments ending in _ptr default to `dtype`; other arguments are i32.
    Needs a process without TRITON_INTERPRET (see run_compile_check).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*" + dtype)
        else:
            signature[name] = pointer_types.get(name, "i32")
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], kernel.fn.__name__


def run_compile_check(call: str) -> None:
    """Run `call` (Python source) in a fresh process where @triton.jit is not the interpreter's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", call], env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
