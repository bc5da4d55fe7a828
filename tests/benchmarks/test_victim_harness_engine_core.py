"""The victim benches find the engine-core process by the name the engine core gives itself."""
from __future__ import annotations

import pytest

from benchmarks.profile.core_share import ENGINE_CORE_PROCESS
from server.engine.core.process import PROCESS_NAME

pytestmark = pytest.mark.unit


def test_the_harness_looks_for_the_engine_cores_own_process_name():
    assert ENGINE_CORE_PROCESS == PROCESS_NAME
