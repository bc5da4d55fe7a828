"""A Python script under scripts/ (not a package) imported as a module, for tests to call its functions."""
from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.repo import ROOT_DIR


def script_module(name: str) -> ModuleType:
    """scripts/<name>.py, executed once per call as module `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT_DIR / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
