"""--lora-page-rows, --unified-memory, --pin-adapter and --max-pinned-adapters-per-tenant: parsed from the
CLI, passed to the engine, refused when invalid (naming the flag)."""
from __future__ import annotations

import pytest

from server.config import ConfigError
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit


def test_flags_reach_the_engine(tmp_path):
    config = serve_config(tmp_path, "--max-lora-rank", "128", "--lora-page-rows", "8", "--pin-adapter", "acme/sql",
                     "--pin-adapter", "chat", "--max-pinned-adapters-per-tenant", "2")
    assert config.pin_adapters == (("acme", "sql"), (None, "chat"))
    lora = config.engine_for("demo").lora
    assert lora.lora_page_rows == 8 and lora.max_pinned_adapters_per_tenant == 2
    assert serve_config(tmp_path).engine.lora.lora_page_rows is None  # off by default: slots
    unified = serve_config(tmp_path, "--lora-page-rows", "8", "--unified-memory")
    assert unified.engine_for("demo").lora.unified_memory and not lora.unified_memory


@pytest.mark.parametrize("flags, names", [
    (("--lora-page-rows", "12"), "--lora-page-rows"),  # not a power of two
    (("--max-lora-rank", "8", "--lora-page-rows", "16"), "--lora-page-rows"),  # does not divide the max rank
    (("--pin-adapter", "a", "--pin-adapter", "b", "--max-pinned-adapters-per-tenant", "1"),
     "--max-pinned-adapters-per-tenant"),
    (("--pin-adapter", "Bad Tenant/x"), "--pin-adapter"),
    (("--unified-memory",), "--unified-memory needs --lora-page-rows"),
])
def test_invalid_values_are_refused_naming_the_flag(tmp_path, flags, names):
    with pytest.raises(ConfigError, match=names):
        serve_config(tmp_path, *flags)
