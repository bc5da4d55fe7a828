"""A tiny model's engine core in its own process, for the tests of the front end's side of it."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from adapters.format import ModelShape
from server.engine.config import EngineConfig
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import CoreStarter
from server.engine.protocol.remote import RemoteEngineClient
from server.engine.protocol.request import EngineRequest
from server.engine.sequence import SamplingParams


def tiny_core(model_dir: Path, redis_url: str, prefix: str, starter: CoreStarter, max_message_bytes: int = 1 << 20,
              **build) -> RemoteEngineClient:
    """A RemoteEngineClient over a started core; `build`: RemoteEngineClient.build's keywords."""
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    config = EngineConfig.of(model=str(model_dir), device="cpu", kv_cache_blocks=64, max_model_len=512)
    return RemoteEngineClient.build(CoreLaunch(
        config, input_address="", parent_pid=0, redis_url=redis_url, redis_prefix=prefix,
        adapter_grace_seconds=600.0, adapter_shape=shape, pager=False,
        max_upload_bytes=1 << 20, max_message_bytes=max_message_bytes), starter, ready_timeout=120, **build)


def greedy_ids(client: RemoteEngineClient, request_id: str) -> list[int]:
    """Four greedy tokens after a fixed prompt, through the core."""
    async def run() -> list[int]:
        stream = await client.submit(EngineRequest(request_id, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0)))
        return [out async for out in stream][-1].token_ids
    return asyncio.run(run())
