"""Directories built once and atomically: the demo model, its adapters, converted GGUF models."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def is_complete(d: Path, files: tuple[str, ...]) -> bool:
    return all((d / f).is_file() for f in files)


def build_atomically(dest: Path, files: tuple[str, ...], build: Callable[[Path], object]) -> None:
    """Build into a sibling temp dir, then rename, so a crash never leaves a
    half-written directory at dest; a concurrent builder's result is kept
    (the output is deterministic, so either copy is the same)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only
        if not is_complete(dest, files):
            if dest.exists():
                shutil.rmtree(dest)  # a leftover from an interrupted build
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
