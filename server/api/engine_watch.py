"""exit_when_engine_dies: with --engine-process separate, an engine core that is gone for good ends the
server.

The client notices a death within a poll interval (server.engine.protocol.remote) and fails every
open stream at once. With --engine-restart it starts a new core (/health 503 and requests 503 with
Retry-After meanwhile) and this watch keeps waiting; once the core is not restarted (the flag off, or
its crash-loop limit reached) the server still answers for ENGINE_DEATH_EXIT_DELAY_S more (the ended
streams' SSE error events flushed), then stops with exit status 1 for its orchestrator to restart it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from server.engine.protocol import EngineClient

log = logging.getLogger(__name__)

ENGINE_DEATH_EXIT_DELAY_S = 1.0
_POLL_S = 0.1


async def exit_when_engine_dies(engine: EngineClient, exit_server: Callable[[], None]) -> None:
    while engine.is_healthy or engine.is_restarting:
        await asyncio.sleep(_POLL_S)
    log.error("the engine core is gone (%s): the server exits with status 1 in %g s", engine.error,
              ENGINE_DEATH_EXIT_DELAY_S)
    await asyncio.sleep(ENGINE_DEATH_EXIT_DELAY_S)
    exit_server()
