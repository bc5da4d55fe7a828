"""The demo adapters shipped for the default model declare it as their base: once they named the
training run's local conversion (`.pytest_cache/.../SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f`),
so uploading one to a server of the default model was warned about as another model's adapter, and
refused under --strict-adapter-base (issue 42, seen as a new user)."""
from __future__ import annotations

import pytest

from server.api.base_identity import declared_base_problem
from server.config import DEFAULT_MODEL_NAME
from server.model_source import SHIPPED_ADAPTERS

SHIPPED = sorted(d for d in SHIPPED_ADAPTERS.iterdir() if (d / "adapter_config.json").is_file())


@pytest.mark.parametrize("adapter", SHIPPED, ids=lambda d: d.name)
def test_a_shipped_adapter_uploads_to_the_default_model_without_a_warning(adapter):
    config = (adapter / "adapter_config.json").read_bytes()
    assert declared_base_problem(config, DEFAULT_MODEL_NAME, None) is None

