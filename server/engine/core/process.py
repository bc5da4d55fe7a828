"""run_core: the engine-core process from its CoreLaunch to its exit status.

The sockets and their threads start first (a front end can say hello while the weights load), then
the engine is built, with the registry fetch and DoRA scale store it would get in the in-process mode
but made here from the Redis URL; then Ready goes to every front end and the busy loop runs on this
(the main) thread until a front end sends shutdown. A failure to start or a crash of the loop is one
Fatal message and exit status 1.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import queue
import signal
import sys
import threading
from functools import partial

import msgspec
import redis
import zmq

from adapters.dora_scale_store import DoraScaleStore
from adapters.loader_pool import LoaderPool
from adapters.registry import AdapterRegistry
from adapters.registry_fetch import registry_fetch
from server.engine.adapter_residency import take_load_times
from server.engine.core.queue_items import CoreFatal, CoreReady, Flush
from server.engine.core.busy_loop import EngineCore
from server.engine.cpu_affinity import pin_process
from server.engine.draft_model_loader import draft_adapter_shape
from server.engine.core.commands import FetchingCommands
from server.engine.core.input_socket import InputSocket
from server.engine.core.launch import CoreLaunch
from server.engine.core.output_socket import OutputSocket
from server.engine.llm_engine import LLMEngine
from server.engine.protocol.info import engine_info

log = logging.getLogger(__name__)

# The core's process name (ps, top, psutil's name()): a forked core's command line is the CLI's.
PROCESS_NAME = "loraplex-core"
PR_SET_NAME = 15  # prctl(2)
REDIS_TIMEOUT_SECONDS = 5.0  # as the front end's (server.api.state): a stuck Redis fails a load, not the core
FLUSH_SECONDS = 2.0


def core_main(raw_launch: bytes) -> int:
    """An engine-core process's life from its msgpack CoreLaunch: spawned (`python -m server.engine.core`,
    from stdin) or forked by `serve` (server.engine.core.reserved, from a pipe)."""
    # The front end owns the core's lifecycle: on SIGINT/SIGTERM it drains its requests, then sends
    # shutdown. A supervisor that signals every process of the group (systemd's control-group kill)
    # must not end the core under requests still draining; it exits anyway once its front end is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # Linux; elsewhere the name stays python's
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, PROCESS_NAME.encode(), 0, 0, 0)
    launch = msgspec.msgpack.decode(raw_launch, type=CoreLaunch)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("loraplex engine core: %(message)s"))
    root = logging.getLogger("server")
    for inherited in list(root.handlers):  # a forked core has the CLI's "loraplex:" one
        root.removeHandler(inherited)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return run_core(launch, os.getpid())


def run_core(launch: CoreLaunch, pid: int) -> int:
    pin_process(pid, launch.engine.device.cpu_affinity)  # before any thread starts: they all inherit the engine's cores
    ctx = zmq.Context()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    inputs = InputSocket(ctx, launch.input_address, launch.max_message_bytes, inbox, outbox)
    outputs = OutputSocket(ctx, outbox, launch.parent_pid, refused=lambda: inputs.refused)
    outputs.start()
    inputs.start()
    with contextlib.ExitStack() as owned:
        try:
            engine = _build_engine(launch, owned)
        except Exception as e:  # noqa: BLE001 - the front end hears why, then we exit
            log.exception("the engine core could not start")
            return _fatal(outbox, f"{type(e).__name__}: {e}")
        owned.callback(engine.shutdown)
        fetching = FetchingCommands(engine, engine.host.fetch, inbox, outbox)
        owned.callback(fetching.shutdown)
        core = EngineCore(engine, inbox, outbox)
        inputs.attach(engine.grammars, fetching)
        # The start-up's objects (weights' wrappers, tokenizer tables, imported modules) live as long as the
        # core: frozen out of the collector, a full collection no longer walks them (it took ~350 ms mid-step
        # at 256 sequences on a loaded CPU), as vLLM's engine core does.
        gc.collect()
        gc.freeze()
        outbox.put(CoreReady(engine_info(engine), core.snapshot, partial(take_load_times, engine), pid))
        try:
            core.run()
        except Exception as e:  # noqa: BLE001 - a bug in the engine: every front end must hear of it
            log.exception("the engine core's step loop crashed")
            return _fatal(outbox, f"the step loop crashed: {type(e).__name__}: {e}")
    _flush(outbox)
    return 0


def _build_engine(launch: CoreLaunch, owned: contextlib.ExitStack) -> LLMEngine:
    client = redis.Redis.from_url(launch.redis_url, decode_responses=False, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                  socket_connect_timeout=REDIS_TIMEOUT_SECONDS, health_check_interval=30)
    owned.callback(client.close)
    pager = None
    if launch.pager:
        pager = LoaderPool(1, launch.max_upload_bytes, cpus=launch.loader_cpus)
        owned.callback(pager.close)
    registry = AdapterRegistry(client, prefix=launch.redis_prefix, grace_seconds=launch.adapter_grace_seconds)
    fetch = registry_fetch(registry, launch.adapter_shape, launch.engine.lora.max_lora_rank, pager,
                           draft_adapter_shape(launch.engine))
    engine = LLMEngine(launch.engine, fetch, DoraScaleStore(client, prefix=launch.redis_prefix))
    if pager is not None:
        pager.wait_ready()
    return engine


def _fatal(outbox: queue.SimpleQueue, error: str) -> int:
    outbox.put(CoreFatal(error))
    _flush(outbox)
    return 1


def _flush(outbox: queue.SimpleQueue) -> None:
    """Wait (briefly) until the output thread has sent everything queued before this."""
    done = threading.Event()
    outbox.put(Flush(done))
    done.wait(FLUSH_SECONDS)
