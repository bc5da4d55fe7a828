"""An engine core that cannot start (a refusal of its engine's) is not restarted, and the front end's
error line says why it gave up: it never started, not the crash-loop limit it never reached."""
from __future__ import annotations

import json
import logging

import pytest

from adapters.format import ModelShape
from server.engine.config import EngineConfig
from server.engine.core.launch import CoreLaunch
from server.engine.protocol.remote import RemoteEngineClient, RestartPolicy


def test_a_core_that_cannot_start_is_not_restarted_and_the_line_says_so(tiny_model_dir, redis_url, caplog,
                                                                        core_starter):
    shape = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    config = EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=512,  # refused
                             tensor_parallel_size=2, fully_sharded_loras=True, lora_page_rows=16)  # as it starts
    launch = CoreLaunch(config, input_address="", parent_pid=0, redis_url=redis_url, redis_prefix="lp-nostart:",
                        adapter_grace_seconds=600.0, adapter_shape=shape, pager=False,
                        max_upload_bytes=1 << 20, max_message_bytes=1 << 20)
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="the engine core did not start"):
        RemoteEngineClient.build(launch, core_starter, ready_timeout=120, restarts=RestartPolicy(3, 60.0))
    # One line, from whichever reaches the front end first: the core's own Fatal message ("the engine core
    # failed: ...") or its exit ("the engine core exited with status ..."). CI once saw the first.
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith(("the engine core failed", "the engine core exited"))]
    assert len(lines) == 1 and lines[0].endswith("(it never started: not restarting)"), lines
