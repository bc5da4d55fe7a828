"""What --model names, made into the Hugging Face directory the engine loads.

`None` is the default real model (server.default_model; the demo tenant gets the adapters shipped
for it in server/assets/smollm2-adapters, and those found under DATA_DIR/demo-adapters, which win
on a name both have), `demo` the tiny random-weight model of the tests (server.demo, with
its adapters), a GGUF file is converted once into the data dir (server.gguf_convert), and anything
else must be a Hugging Face model directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from server import default_model
from server.atomic_dir import is_complete
from server.config import DEMO_MODEL_FLAG, valid_adapter_name
from server.demo import DemoPaths, ensure_demo
from server.gguf_convert import ensure_converted
from server.gguf_reader import is_gguf

CONVERTED_DIR = "models"  # under the data dir: one converted directory per GGUF content
# Under the data dir: PEFT directories the demo tenant gets with the default model, e.g. what
# scripts/train_demo_adapters.py writes (--out DATA_DIR/demo-adapters).
DEFAULT_MODEL_ADAPTERS_DIR = "demo-adapters"
# The demo adapters trained for the default model (french, json, pirate), shipped with the package;
# docs/benchmarks/eval-real-model.md gives the command that made them and what they score.
SHIPPED_ADAPTERS = Path(__file__).parent / "assets" / "smollm2-adapters"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ResolvedModel:
    model_dir: Path
    demo: DemoPaths | None = None  # the demo model's adapters, for the demo tenant


def resolve_model(model: str | None, data_dir: Path, say: Callable[[str], None]) -> ResolvedModel:
    """Blocking: may convert a GGUF (a minute for SmolLM2) or build the demo model; cheap once done."""
    if model == DEMO_MODEL_FLAG:
        demo = ensure_demo(Path(data_dir) / "demo", say)
        return ResolvedModel(demo.model_dir, demo)
    if model is None:
        model_dir = ensure_converted(default_model.packaged_gguf(), Path(data_dir) / CONVERTED_DIR, say)
        adapters = {**_adapter_dirs(SHIPPED_ADAPTERS), **_adapter_dirs(Path(data_dir) / DEFAULT_MODEL_ADAPTERS_DIR)}
        return ResolvedModel(model_dir, DemoPaths(model_dir, adapters) if adapters else None)
    if is_gguf(model):
        return ResolvedModel(ensure_converted(Path(model), Path(data_dir) / CONVERTED_DIR, say))
    return ResolvedModel(Path(model))


def _adapter_dirs(root: Path) -> dict[str, Path]:
    """name -> PEFT directory, for each complete one under root whose name is a valid adapter name."""
    if not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if valid_adapter_name(d.name) and is_complete(d, ADAPTER_FILES)}
