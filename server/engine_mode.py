"""--engine-process: the engine client the server's state holds, in this process or an engine core's.

Outside server/api: the HTTP side gets an EngineClient and never
imports either implementation (tests/server/api/test_engine_boundary.py); the app holds the
CoreStarter it is handed (or makes one) as an opaque object from here.
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
from server.engine.draft_model_loader import draft_adapter_shape
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import CoreStarter
from server.engine.data_parallel.launch import attach_data_parallel, build_data_parallel
from server.engine.protocol.client import EngineClient
from server.engine.async_engine import InProcessEngineClient
from server.engine.protocol.remote import RemoteEngineClient, RestartPolicy


def core_launch(config: ServerConfig, engine: EngineConfig, redis_url: str, shape: ModelShape,
                pager: bool) -> CoreLaunch:
    """What an engine-core process starts with, its input address left for whoever spawns it. The core
    builds its own registry fetch and DoRA scale store from these (adapters cross as version ids)."""
    return CoreLaunch(
        engine, input_address="", parent_pid=0, redis_url=redis_url, redis_prefix=config.redis_prefix,
        adapter_grace_seconds=config.adapter_grace_seconds, adapter_shape=shape,
        pager=pager, max_upload_bytes=config.max_upload_bytes,
        loader_cpus=config.cpu_placement.api if config.cpu_placement is not None else None)


def restart_policy(config: ServerConfig) -> RestartPolicy | None:
    """--engine-restart's policy for one engine core (each data-parallel core has its own)."""
    return RestartPolicy(config.engine_restart_limit, ENGINE_RESTART_WINDOW_S) if config.engine_restart else None


def build_engine_client(config: ServerConfig, engine: EngineConfig, redis_url: str, shape: ModelShape,
                        registry: AdapterRegistry, pager: LoaderPool | None, client: redis.Redis,
                        starter: CoreStarter) -> EngineClient:
    """The engine client --engine-process asks for (blocking: the weights load, here or in the core,
    started with `starter`); one of several front ends (--api-server-count) attaches to the core(s) its
    parent runs."""
    if config.engine_addresses:
        launch = core_launch(config, engine, redis_url, shape, pager is not None)
        if len(config.engine_addresses) == 1:
            return RemoteEngineClient.attach(launch, config.engine_addresses[0])
        return attach_data_parallel(config, launch)
    if config.data_parallel_size > 1:
        return build_data_parallel(config, engine,
                                   lambda one: core_launch(config, one, redis_url, shape, pager is not None),
                                   lambda: restart_policy(config), starter)
    if config.engine_process == "separate":
        return RemoteEngineClient.build(core_launch(config, engine, redis_url, shape, pager is not None), starter,
                                        restarts=restart_policy(config))
    fetch = registry_fetch(registry, shape, config.engine.lora.max_lora_rank, pager, draft_adapter_shape(engine))
    return InProcessEngineClient.build(engine, fetch, DoraScaleStore(client, prefix=config.redis_prefix))
