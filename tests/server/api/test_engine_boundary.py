"""The HTTP side reaches the engine through its client protocol only (server.engine.protocol):
no module under server/api imports the LLMEngine, the step loop, the scheduler or the model."""
from __future__ import annotations

import ast

import pytest
from tests.repo import ROOT_DIR

pytestmark = pytest.mark.unit

API_DIR = ROOT_DIR / "server" / "api"
# Engine modules the front end may import: the protocol, request parameters, and tokenizing and grammar
# compiling (front-end work). The engine's config and its client (in-process or an engine core's) are
# built outside it (server.config, server.engine_mode).
ALLOWED_MODULES = {
    "server.engine.protocol",
    "server.engine.structured_outputs", "server.engine.tokenizer_loader",
    "server.engine.grammar", "server.engine.grammar_worker",
}
# Names the front end may take from the server.engine package itself.
ALLOWED_PACKAGE_NAMES = {"SamplingParams", "StructuredOutputsParams"}


def _is_engine(module: str) -> bool:
    return module == "server.engine" or module.startswith("server.engine.")


def _engine_imports(path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and _is_engine(node.module):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if _is_engine(a.name)]
    return found


def test_api_modules_import_no_engine_internals():
    bad = []
    for path in sorted(API_DIR.rglob("*.py")):
        for module, names in _engine_imports(path):
            if module == "server.engine":
                bad += [f"{path.name}: server.engine.{n}" for n in names if n not in ALLOWED_PACKAGE_NAMES]
            elif module not in ALLOWED_MODULES:
                bad.append(f"{path.name}: {module}")
    assert not bad, "server/api reaches past the engine protocol: " + ", ".join(bad)


def test_api_modules_reach_no_engine_attributes():
    """`state.engine` is an EngineClient: nothing under server/api reads the in-process client's own
    LLMEngine (`.engine.engine`) or runs code on its loop thread (`.engine.call` / `.engine.post`)."""
    bad = []
    for path in sorted(API_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ("engine", "call", "post")
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"):
                bad.append(f"{path.name}:{node.lineno} .engine.{node.attr}")
    assert not bad, ", ".join(bad)
