"""CoreLaunch: everything an engine-core process is started with, sent on its stdin as msgpack."""
from __future__ import annotations

import msgspec

from adapters.format import ModelShape
from server.engine.config import EngineConfig

# The largest message a front end may send the core (ZMQ refuses a bigger one before reading it):
# room for a compiled grammar of a large vocabulary; prompts are a few hundred KiB at most.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class CoreLaunch(msgspec.Struct):
    engine: EngineConfig
    input_address: str  # the core binds its input ROUTER socket here (an ipc:// path the front end chose)
    parent_pid: int  # the front end: the core exits when it is gone
    # The core pages adapters in from the registry itself (adapters.registry_fetch): its Redis and keys.
    redis_url: str
    redis_prefix: str
    adapter_grace_seconds: float
    adapter_shape: ModelShape
    pager: bool  # parse stored versions in a loader process (as the in-process mode does with loaders)
    max_upload_bytes: int
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # The front end's cores (server.cpu_placement): the core's own loader process runs there, while the
    # core moves itself onto engine.device.cpu_affinity. None: not pinned.
    loader_cpus: tuple[int, ...] | None = None
