"""build_data_parallel: start --data-parallel-size engine cores, each on its share of the engine's cores;
attach_data_parallel: one of --api-server-count front ends, over the cores its parent started."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.cpu_list import format_cpu_list
from server.engine.config import EngineConfig
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import CoreStarter
from server.engine.data_parallel.client import DataParallelEngineClient
from server.engine.data_parallel.core_split import core_configs
from server.engine.protocol.remote import RemoteEngineClient, RestartPolicy

if TYPE_CHECKING:
    from server.config import ServerConfig

log = logging.getLogger(__name__)


def placed_configs(engine: EngineConfig, n: int) -> list[EngineConfig]:
    """The N cores' configs (core_split), each core's place logged."""
    configs = core_configs(engine, n)
    for i, one in enumerate(configs):
        cores = one.device.cpu_affinity
        where = f"cores {format_cpu_list(cores)}" if cores is not None else one.device.device
        log.info("data parallel: engine core %d on %s (torch threads %s)", i, where, one.device.resolve_cpu_threads())
    return configs


def build_data_parallel(config: ServerConfig, engine: EngineConfig, launch_of: Callable[[EngineConfig], CoreLaunch],
                        restarts: Callable[[], RestartPolicy | None],
                        starter: CoreStarter) -> DataParallelEngineClient:
    """Blocking: every core's weights loaded and pools sized. `launch_of`: a core's CoreLaunch from its
    EngineConfig (server.engine_mode.core_launch with the server's Redis and adapter settings);
    `restarts`: a fresh --engine-restart policy (each core counts its own restarts); `starter`: the
    server's, which every core is started and restarted with."""
    configs = placed_configs(engine, config.data_parallel_size)

    def start_core(one: EngineConfig, policy: RestartPolicy | None):
        return lambda: RemoteEngineClient.build(launch_of(one), starter, restarts=policy)

    return DataParallelEngineClient.build([start_core(one, restarts()) for one in configs],
                                          config.data_parallel_routing)


def attach_data_parallel(config: ServerConfig, launch: CoreLaunch) -> DataParallelEngineClient:
    """Blocking, in one of several front ends: a channel of this process's own to each engine core the
    parent runs (server.front_ends), ready once every core is. The parent restarts a dead core at its
    address; this front end's router reads each core's load from the core's own stats, which count
    every front end's requests (server.engine.data_parallel.client)."""

    def attacher(address: str):
        return lambda: RemoteEngineClient.attach(launch, address)

    return DataParallelEngineClient.build([attacher(a) for a in config.engine_addresses],
                                          config.data_parallel_routing)
