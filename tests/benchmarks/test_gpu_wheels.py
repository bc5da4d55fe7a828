"""benchmarks/gpu_wheels carries what the device machine lacks: every runtime dependency in pyproject is either
downloaded by it or listed as already in the device image, and the download folder is git-ignored."""
from __future__ import annotations

import re
import tomllib

import pytest

from tests.repo import ROOT_DIR as ROOT

pytestmark = pytest.mark.unit


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _bash_array(text: str, name: str) -> set[str]:
    body = re.search(rf"^{name}=\((.*?)\)", text, re.M | re.S)
    assert body, f"no {name}=(...) in benchmarks/gpu_wheels"
    return {_normal(w) for w in body.group(1).split()}


def test_wheels_and_the_device_image_cover_every_runtime_dependency():
    script = (ROOT / "benchmarks" / "gpu_wheels").read_text()
    carried, on_device = _bash_array(script, "PACKAGES"), _bash_array(script, "DEVICE_HAS")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    runtime = {_normal(re.match(r"[A-Za-z0-9_.-]+", d).group(0)) for d in deps}
    assert runtime - carried - on_device == set()
    assert carried & on_device == set()  # one version of each: two stop the device's install
    assert {"openai", "httpx2", "httpcore2"} <= carried  # the client tests' imports (httpx2: openai's client)


def test_the_wheel_folder_is_ignored():
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()
