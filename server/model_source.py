"""What --model names, made into the Hugging Face directory the engine loads.

`None` is the default real model (server.default_model), `demo` the tiny random-weight model of the
tests (server.demo, with its adapters), a GGUF file is converted once into the data dir
(server.gguf_convert), and anything else must be a Hugging Face model directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from server import default_model
from server.config import DEMO_MODEL_FLAG
from server.demo import DemoPaths, ensure_demo
from server.gguf_convert import ensure_converted
from server.gguf_reader import is_gguf

CONVERTED_DIR = "models"  # under the data dir: one converted directory per GGUF content


@dataclass(frozen=True)
class ResolvedModel:
    model_dir: Path
    demo: DemoPaths | None = None  # the demo model's adapters, for the demo tenant


def resolve_model(model: str | None, data_dir: Path, say: Callable[[str], None]) -> ResolvedModel:
    """Blocking: may convert a GGUF (a minute for SmolLM2) or build the demo model; cheap once done."""
    if model == DEMO_MODEL_FLAG:
        demo = ensure_demo(Path(data_dir) / "demo")
        return ResolvedModel(demo.model_dir, demo)
    if model is None:
        gguf = default_model.packaged_gguf()
    elif is_gguf(model):
        gguf = Path(model)
    else:
        return ResolvedModel(Path(model))
    return ResolvedModel(ensure_converted(gguf, Path(data_dir) / CONVERTED_DIR, say))
