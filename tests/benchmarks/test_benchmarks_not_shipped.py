"""The installed package does not need benchmarks/: no product module imports it, importing every product
module leaves none of it in sys.modules, and pyproject's package discovery leaves it out of the wheel."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_namespace_packages
from tests.repo import ROOT_DIR as ROOT

PRODUCT = ("server", "adapters", "kernels", "tenants")


def product_modules() -> dict[str, Path]:
    """Every module of the product packages, by dotted name."""
    out = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def is_benchmarks(name: str | None) -> bool:
    return name is not None and name.split(".")[0] == "benchmarks"


def benchmarks_imports(path: Path) -> list[str]:
    """The imports of benchmarks in a file: import statements and import_module/__import__ calls."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if is_benchmarks(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_benchmarks(node.module):
            found.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if fn in ("import_module", "__import__") and is_benchmarks(str(node.args[0].value)):
                found.append(node.args[0].value)
    return found


def test_no_product_file_imports_benchmarks() -> None:
    modules = product_modules()
    assert len(modules) > 100  # the walk found the packages
    hits = {name: benchmarks_imports(path) for name, path in modules.items()}
    assert {name: found for name, found in hits.items() if found} == {}


def test_the_check_sees_an_import_of_benchmarks(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\nimport benchmarks.profile\nfrom benchmarks.aot import aot\n"
                     "importlib.import_module('benchmarks.eval')\n")
    assert benchmarks_imports(probe) == ["benchmarks.profile", "benchmarks.aot", "benchmarks.eval"]


def test_importing_every_product_module_loads_no_benchmarks_module() -> None:
    """In a fresh interpreter, so that nothing this test session imported counts."""
    code = ("import importlib, json, sys\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks')))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(product_modules()))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_package_discovery_leaves_benchmarks_out() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_namespace_packages(str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", ()))
    assert {"server", "server.bench", "adapters", "kernels", "tenants"} <= set(packages)
    assert [p for p in packages if is_benchmarks(p)] == []


# What the product is entered by: the console script, the Python API and the engine core's `-m` module.
ENTRY_MODULES = ("server.cli", "server.engine", "server.engine.core", "server.engine.core.__main__")


def product_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules a file imports: statements anywhere in it (lazy ones included) and dotted names in
    string constants (import_module, multiprocessing preloads, `-m` command lines)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return {name for name in found if name in modules}


def reachable(modules: dict[str, Path], entries: tuple[str, ...] = ENTRY_MODULES) -> set[str]:
    seen: set[str] = set()
    todo = [m for m in entries if m in modules]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a module runs its packages
        todo += product_imports(modules[name], modules)
    return seen


def test_every_product_module_serves_the_product() -> None:
    """Nothing under the installed package is there only for scripts or tests (issue 40): every module is
    reached from an entry point by imports."""
    modules = product_modules()
    assert {m for m in ENTRY_MODULES if m in modules} == set(ENTRY_MODULES)
    assert sorted(set(modules) - reachable(modules)) == []


def test_the_reach_check_sees_a_module_only_tests_use(tmp_path: Path) -> None:
    (tmp_path / "entry.py").write_text("import used\n")
    (tmp_path / "used.py").write_text("X = 1\n")
    (tmp_path / "orphan.py").write_text("import used\n")
    modules = {p.stem: p for p in tmp_path.glob("*.py")}
    assert product_imports(modules["entry"], modules) == {"used"}
    assert set(modules) - reachable(modules, ("entry",)) == {"orphan"}
