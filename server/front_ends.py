"""--api-server-count N: one parent process, N front-end processes on one port, and the engine core (or,
with --data-parallel-size M, M engine cores) they all share.

The parent holds what a server must have once: the listening socket (bound by the CLI), the embedded
Redis (its URL goes to every front end), and the engine core(s), each spawned on an input address that
stays the same across its restarts (--engine-restart: the parent restarts it under its own policy; the
front ends notice the missing heartbeat and say Hello again, server.engine.protocol.remote's attached
mode). Each front end is a spawned process running the Starlette app under uvicorn on a listening
socket of its own, all bound by the parent to the one port with SO_REUSEPORT (the kernel spreads
connections over them by their addresses' hash), with its own channel to every core: a request's
outputs come back to the process that sent it. With M cores each front end routes its requests itself
(server.engine.data_parallel), by residency and load it reads from the cores' own stats, which count
every front end's requests, so that two front ends do not both pick the core each thinks idle.

Front end 0 starts first and alone does the once-per-server work (ServerConfig.runs_singletons: the
start-up writes, --pin-adapter, the store's upkeep, the adapter-retirement listener); the others start
once it is ready, so none serves before the demo key and preloads exist. Per-process by design: the
usage settlement loop (each settles its own running requests into Redis), the lease heartbeat (each
process's Limiter holder), the loader and grammar-compile processes, the console's engine history.

SIGTERM or SIGINT to the parent: each front end is told to stop (SIGTERM: it drains, within
--shutdown-timeout; a second signal is passed on as SIGINT, which stops them at once), then the core
is sent shutdown and Redis stopped. Front ends run in sessions of their own, so a terminal's Ctrl-C
reaches the parent only, and each exits by itself if the parent is gone. A front end that dies, or a
core that is not restarted, stops the rest: the parent exits 1 for its orchestrator.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

from adapters.format import ModelShape
from server.api.bootstrap import StartupInfo
from server.config import ServerConfig
from server.embedded_redis import DATA_SUBDIR
from server.embedded_redis.server import EmbeddedRedis
from server.engine.core.commands import SHUTDOWN
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import CoreStarter
from server.engine.core.messages import Command
from server.engine.data_parallel.launch import placed_configs
from server.engine.protocol.remote import SHUTDOWN_WAIT_S, RestartPolicy
from server.engine_mode import core_launch, restart_policy
from server.model_source import resolve_model
from server.starting_responder import StartingResponder

log = logging.getLogger(__name__)

POLL_S = 0.2
PARENT_CHECK_S = 0.5
STOP_MARGIN_S = 15.0  # past --shutdown-timeout: a front end's lifespan shutdown, before it is killed


@dataclasses.dataclass(frozen=True)
class FrontEndReady:
    """A front end's word to the parent that it serves (front end 0's carries the banner's info)."""

    index: int
    pid: int
    info: StartupInfo | None


class CoreOwner:
    """One engine-core process at a fixed input address, restarted there on death while the policy
    allows (and once front ends were served by it: a core that never started would fail again)."""

    def __init__(self, launch: CoreLaunch, restarts: RestartPolicy | None, starter: CoreStarter) -> None:
        self._launch = launch
        self.address = launch.input_address
        self._starter = starter
        self._restarts = restarts
        self._stopping = False
        self.served = False
        self.gave_up = False
        self._proc = starter.start(launch)
        threading.Thread(target=self._watch, name="core-owner", daemon=True).start()

    def _watch(self) -> None:
        while True:
            code = self._proc.wait()
            if self._stopping:
                return
            if self._restarts is None or not self.served or not self._restarts.allow(time.monotonic()):
                why = "" if self._restarts is None or not self.served else f" ({self._restarts.describe()} reached)"
                log.error("the engine core at %s exited with status %d%s: stopping the server", self.address, code, why)
                self.gave_up = True
                return
            log.error("the engine core at %s exited with status %d; starting a new one at the same address",
                      self.address, code)
            self._proc = self._starter.start(self._launch)

    def stop(self) -> None:
        """After the front ends: tell the core to stop (it finishes its queues), kill it past the wait."""
        self._stopping = True
        if self._proc.poll() is None:
            ctx = zmq.Context()
            try:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 1000)
                dealer.connect(self._launch.input_address)
                dealer.send(msgspec.msgpack.encode(Command(0, SHUTDOWN)))
                self._proc.wait(SHUTDOWN_WAIT_S)
            except (zmq.ZMQError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            finally:
                ctx.destroy(linger=0)


def front_end_main(config: ServerConfig, sock: socket.socket, ready: multiprocessing.Queue) -> None:
    """A spawned front end's body: the app under uvicorn on the parent's listening socket."""
    from server.cli import log_to_stderr, serve

    os.setsid()  # a terminal's Ctrl-C goes to the parent, which passes the stop on
    log_to_stderr()
    parent = os.getppid()
    threading.Thread(target=_stop_without_parent, args=(parent,), name="parent-watch", daemon=True).start()

    def on_ready(info: StartupInfo) -> None:
        ready.put(FrontEndReady(config.front_end_index, os.getpid(), info if config.runs_singletons else None))

    sys.exit(serve(config, sock, on_ready=on_ready, place_cpus=False))


def _stop_without_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _launches(config: ServerConfig, redis_url: str, workdir: str) -> list[CoreLaunch]:
    """Each engine core's launch at its input address: one, or --data-parallel-size on their shares
    of the engine's cores (server.engine.data_parallel.core_split)."""
    model_dir = str(resolve_model(config.model, Path(config.data_dir), log.info).model_dir)
    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    engine = config.engine_for(model_dir)
    engines = placed_configs(engine, config.data_parallel_size) if config.data_parallel_size > 1 else [engine]
    return [msgspec.structs.replace(core_launch(config, one, redis_url, shape, config.uses_loader_processes),
                                    input_address=f"ipc://{workdir}/core-{i}", parent_pid=os.getpid())
            for i, one in enumerate(engines)]


class _Stops:
    """The parent's SIGINT/SIGTERM: the first asks the front ends to drain, the next to stop at once."""

    def __init__(self) -> None:
        self.count = 0
        self.pids: list[int] = []

    def __call__(self, signum: int, frame) -> None:
        self.count += 1
        if self.count == 1:
            print(f"loraplex: {signal.Signals(signum).name} received: stopping {len(self.pids)} front end(s)",
                  file=sys.stderr, flush=True)
        self.forward()

    def forward(self) -> None:
        sig = signal.SIGTERM if self.count <= 1 else signal.SIGINT
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def run_front_ends(config: ServerConfig, sock: socket.socket, starter: CoreStarter,
                   starting: StartingResponder) -> int:
    """The parent's life; its exit status: 0 after a stop, 1 when a front end or the core died. `starter`
    (the CLI's, holding the core it reserved) starts the core and restarts it; `starting`: the CLI's 503
    answerer on `sock`. Each socket is answered 503 here until its front end is spawned (which answers
    503 itself until it is ready)."""
    from server.cli import banner, bind_listener, place_cpus_of

    place_cpus_of(config)  # the parent on the front ends' cores: the spawned ones inherit it
    stops = _Stops()
    previous = {sig: signal.signal(sig, stops) for sig in (signal.SIGINT, signal.SIGTERM)}
    workdir = tempfile.mkdtemp(prefix="loraplex-cores-")
    with contextlib.ExitStack() as owned:
        owned.callback(shutil.rmtree, workdir, ignore_errors=True)
        for sig, handler in previous.items():
            owned.callback(signal.signal, sig, handler)
        redis_url = config.redis_url
        if redis_url is None:
            embedded = EmbeddedRedis.start(Path(config.data_dir) / DATA_SUBDIR)
            owned.callback(embedded.stop)
            redis_url = embedded.url
        cores = []
        for launch in _launches(config, redis_url, workdir):  # each core restarts on its own policy
            cores.append(CoreOwner(launch, restart_policy(config), starter))
            owned.callback(cores[-1].stop)
        addresses = tuple(core.address for core in cores)
        # One SO_REUSEPORT socket per front end on the CLI's port (the first is the CLI's own).
        sockets = [sock]
        answering = [starting]

        def stop_answering() -> None:
            for responder in answering:
                responder.stop()
        owned.callback(stop_answering)
        for _ in range(1, config.api_server_count):
            sockets.append(owned.enter_context(bind_listener(config.host, sock.getsockname()[1], reuse_port=True)))
            answering.append(StartingResponder(sockets[-1]).start())
        ctx = multiprocessing.get_context("spawn")
        ready: multiprocessing.Queue = ctx.Queue()
        procs: list[multiprocessing.Process] = []
        owned.callback(_join_all, procs, config.shutdown_timeout + STOP_MARGIN_S)

        def start(index: int) -> None:
            fe = dataclasses.replace(config, redis_url=redis_url, engine_addresses=addresses, front_end_index=index)
            proc = ctx.Process(target=front_end_main, args=(fe, sockets[index], ready),
                               name=f"loraplex-front-end-{index}")
            answering[index].stop()  # the socket is the front end's from here
            proc.start()
            procs.append(proc)
            stops.pids.append(proc.pid)

        start(0)
        heard = _wait_ready(ready, procs, cores, stops, 1)
        if heard is None:
            return 0 if stops.count else _stop_all(stops)
        for core in cores:
            core.served = True
        for index in range(1, config.api_server_count):
            start(index)
        more = _wait_ready(ready, procs, cores, stops, config.api_server_count - 1)
        if more is None:
            return 0 if stops.count else _stop_all(stops)
        banner(heard[0].info, config.shutdown_timeout)
        print(f"loraplex: {config.api_server_count} front ends (pids "
              f"{', '.join(str(r.pid) for r in sorted(heard + more, key=lambda r: r.index))}) share "
              f"{'one engine core' if len(cores) == 1 else f'{len(cores)} engine cores'}", file=sys.stderr, flush=True)
        while not stops.count:
            if any(core.gave_up for core in cores) or any(p.exitcode is not None for p in procs):
                return _stop_all(stops)
            time.sleep(POLL_S)
        _join_all(procs, config.shutdown_timeout + STOP_MARGIN_S)
        return 0 if all(p.exitcode == 0 for p in procs) else 1


def _wait_ready(ready: multiprocessing.Queue, procs: list, cores: list[CoreOwner], stops: _Stops,
                count: int) -> list[FrontEndReady] | None:
    """`count` ready front ends, or None once one died, a core gave up or a stop came."""
    heard: list[FrontEndReady] = []
    while len(heard) < count:
        if stops.count or any(core.gave_up for core in cores) or any(p.exitcode is not None for p in procs):
            return None
        with contextlib.suppress(queue.Empty):
            heard.append(ready.get(timeout=POLL_S))
    return heard


def _stop_all(stops: _Stops) -> int:
    """An unplanned end (a front end or the core died, or a stop during start-up): the rest drain."""
    stops.count = max(stops.count, 1)
    stops.forward()
    return 1


def _join_all(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            log.error("front end %s did not stop within %g s: killed", proc.name, timeout)
            proc.kill()
            proc.join()
