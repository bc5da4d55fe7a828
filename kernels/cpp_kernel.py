"""Building and loading the small C++ CPU kernels (kernels/*_avx2.cpp) with the system's compiler.

No torch headers: the sources need only <immintrin.h>, so a build takes seconds, not the minute that
torch.utils.cpp_extension takes. A library is cached under `cache_dir` by a hash of its source, the
flags and the compiler, written to a temporary name and renamed into place, so concurrent engines
starting at once neither rebuild nor load a half-written file. It links libgomp by SONAME, which
resolves to the copy torch has already loaded: one OpenMP runtime in the process.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
REQUIRED_FLAGS = frozenset({"avx2", "fma"})  # /proc/cpuinfo names of what the kernels execute
BUILD_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """No compiler, or the compiler refused the source; the message says which and why."""


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$XDG_CACHE_HOME/loraplex/kernels, else ~/.cache/loraplex/kernels."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "loraplex" / "kernels"


def build_library(source: Path, cache_dir: Path | None = None, compiler: str | None = None) -> Path:
    """The compiled `source`'s path, building it unless a build of this source, these flags and this
    compiler is cached. compiler: a C++ compiler's name or path (default $CXX, else g++).
    Raises KernelBuildError."""
    compiler = compiler or os.environ.get("CXX") or "g++"
    exe = shutil.which(compiler)
    if exe is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} on PATH")
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), exe.encode()])).hexdigest()[:16]
    cache_dir = cache_dir or default_cache_dir()
    lib = cache_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=cache_dir)
    os.close(fd)
    try:
        run = subprocess.run([exe, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
        if run.returncode != 0:
            raise KernelBuildError(f"{exe} failed ({run.returncode}): {run.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    except subprocess.TimeoutExpired:
        raise KernelBuildError(f"{exe} took over {BUILD_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load_entry(source: Path, entry: str, argtypes: list, cache_dir: Path | None = None,
               compiler: str | None = None):
    """The ctypes function `entry` of the compiled `source` (built if need be), returning nothing.
    Raises KernelBuildError."""
    try:
        path = build_library(source, cache_dir, compiler)
    except OSError as e:  # an unwritable cache directory, a compiler that cannot be executed
        raise KernelBuildError(f"cannot build the kernel: {e}") from None
    try:
        kernel = getattr(ctypes.CDLL(str(path)), entry)
    except OSError as e:
        raise KernelBuildError(f"cannot load the built kernel: {e}") from None
    kernel.argtypes = argtypes
    kernel.restype = None
    return kernel
