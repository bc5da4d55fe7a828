"""--engine-process: the engine client the server's state holds, in this process or an engine core's.

Outside server/api, like server.engine_settings: the HTTP side gets an EngineClient and never
imports either implementation (tests/server/api/test_engine_boundary.py).
"""
from __future__ import annotations

import redis

from adapters.dora_scale_store import DoraScaleStore
from adapters.format import ModelShape
from adapters.loader_pool import LoaderPool
from adapters.registry import AdapterRegistry
from adapters.registry_fetch import registry_fetch
from server.config import ENGINE_RESTART_WINDOW_S, ServerConfig
from server.engine.config import EngineConfig
from server.engine.core.launch import CoreLaunch
from server.engine.protocol.client import EngineClient
from server.engine.protocol.in_process import InProcessEngineClient
from server.engine.protocol.remote import RemoteEngineClient, RestartPolicy


def build_engine_client(config: ServerConfig, engine: EngineConfig, redis_url: str, shape: ModelShape,
                  registry: AdapterRegistry, pager: LoaderPool | None, client: redis.Redis) -> EngineClient:
    """The engine client --engine-process asks for (blocking: the weights load, here or in the core)."""
    if config.engine_process == "separate":
        # The core builds its own registry fetch and DoRA scale store from these (adapters cross as version ids).
        return RemoteEngineClient.build(CoreLaunch(
            engine, input_address="", parent_pid=0, redis_url=redis_url, redis_prefix=config.redis_prefix,
            adapter_grace_seconds=config.adapter_grace_seconds, adapter_shape=shape,
            max_lora_rank=config.max_lora_rank, pager=pager is not None, max_upload_bytes=config.max_upload_bytes,
            loader_cpus=config.cpu_placement.api if config.cpu_placement is not None else None),
            restarts=RestartPolicy(config.engine_restart_limit, ENGINE_RESTART_WINDOW_S) if config.engine_restart
            else None)
    return InProcessEngineClient.build(engine, registry_fetch(registry, shape, config.max_lora_rank, pager),
                                       DoraScaleStore(client, prefix=config.redis_prefix))
