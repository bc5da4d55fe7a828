"""A real loraplex app under a real uvicorn on a free port (in a thread), on the
session's redis-server, serving the tiny model. Module-scoped: starting the
engine is the slow part, so each test module shares one server."""
from __future__ import annotations

import contextlib
import functools
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import pytest
import redis
import uvicorn

from server.api.app import create_app
from server.api.state import ServerState
from server.config import ServerConfig
from server.embedded_redis.server import EmbeddedRedis, free_port
from server.engine.core.launcher import CoreStarter
from server.engine.scheduler import SchedulerStats
from server.engine.tokenizer_loader import load_tokenizer

ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
API_DB = 1  # the redis fixtures flush db 0 per test; servers live in db 1
PAUSE_NAP_S = 0.1  # engine_paused's naps: two always queued, so a loaded machine cannot slip a step in


@dataclass
class ServerHandle:
    config: ServerConfig
    app: object
    url: str

    @property
    def state(self) -> ServerState:
        return self.app.state.lp

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        with self.http(self.config.admin_token) as c:
            return c.request(method, path, **kw)

    def new_tenant(self, quota: dict | None = None, name: str | None = None) -> tuple[str, str]:
        """(tenant name, API key) of a fresh tenant."""
        name = name or f"t-{secrets.token_hex(4)}"
        r = self.admin("POST", "/admin/tenants", json={"name": name, "quota": quota or {}})
        assert r.status_code == 201, r.text
        r = self.admin("POST", f"/admin/tenants/{name}/keys")
        assert r.status_code == 201, r.text
        return name, r.json()["key"]

    @functools.cached_property
    def tokenizer(self):
        """The served model's tokenizer, the test's own copy (the engine's is the engine's, in its process)."""
        return load_tokenizer(self.config.model)

    @contextlib.contextmanager
    def engine_paused(self) -> Iterator[None]:
        """Hold the engine's step loop (between steps) so running requests stay running: the tiny model
        finishes hundreds of tokens in well under a second. Through EngineClient.nap, so in either engine
        mode: naps of PAUSE_NAP_S with two always queued behind the running one, so no step slips between."""
        engine = self.state.engine
        naps = deque(engine.nap(PAUSE_NAP_S) for _ in range(3))
        naps.popleft().result(30)  # the loop is in the second nap now: paused
        release = threading.Event()

        def keep() -> None:
            while not release.is_set():
                naps.append(engine.nap(PAUSE_NAP_S))
                naps.popleft().result(30)
        thread = threading.Thread(target=keep, daemon=True)
        thread.start()
        try:
            yield
        finally:
            release.set()
            thread.join(5)

    @contextlib.contextmanager
    def engine_paused_once(self, ready: Callable[[SchedulerStats], bool], what: str,
                           timeout_s: float = 60) -> Iterator[SchedulerStats]:
        """engine_paused() as soon as `ready(the scheduler's stats)` holds while paused; yields those stats.
        Checked unpaused first, then again paused: under load a request could finish (or start) between a
        check and the pause. Fails with `what` after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert time.monotonic() < deadline, what
            if not ready(self.state.engine.stats().scheduler):
                time.sleep(0.02)
                continue
            with self.engine_paused():
                stats = self.state.engine.stats().scheduler
                if ready(stats):
                    yield stats
                    return
            time.sleep(0.2)  # the naps queued behind the pause run out before the loop steps again

    @contextlib.contextmanager
    def engine_throttled(self, pause_s: float = 0.02) -> Iterator[None]:
        """Slow the engine to about one step per pause_s in-process, so a request is still
        mid-generation when the test acts on it. An engine core steps on while the next nap crosses
        the socket: 2-3 steps per pause_s there, so a test that needs a generation to last long
        sizes pause_s for that."""
        stop = threading.Event()

        def feed() -> None:
            while not stop.is_set():
                try:  # one nap at a time: the loop steps once between naps
                    self.state.engine.nap(pause_s).result(30)
                except Exception:  # noqa: BLE001 - the engine is gone: nothing left to slow
                    return
        thread = threading.Thread(target=feed, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def upload(self, key: str, name: str, adapter_dir: Path, replace: bool = False) -> httpx.Response:
        d = Path(adapter_dir)
        files = {"adapter_config.json": ("adapter_config.json", (d / "adapter_config.json").read_bytes()),
                 "adapter_model.safetensors": ("adapter_model.safetensors",
                                               (d / "adapter_model.safetensors").read_bytes())}
        data = {"name": name, "replace": "true" if replace else "false"}
        with self.http(key) as c:
            return c.post("/v1/adapters", data=data, files=files)


@pytest.fixture(scope="session")
def core_starter() -> Iterator[CoreStarter]:
    """One CoreStarter for the session's engine cores, as `serve` has one per process: its fork server
    (seconds of imports) is shared by every server and client that is handed it."""
    starter = CoreStarter()
    try:
        yield starter
    finally:
        starter.close()


@contextlib.contextmanager
def running_server(config: ServerConfig, timeout: float = 120.0,
                   starter: CoreStarter | None = None) -> Iterator[ServerHandle]:
    """`starter`: the engine cores' (None: the app's own, closed with it). Pass the session's `core_starter`
    unless the test needs a fork server of its own: an own starter starts a fork server that imports torch
    and the engine again (3.4 CPU-s a server on a 2-core dev machine), a shared one only forks."""
    app = create_app(config, starter=starter)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited during start-up (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start in time")
        time.sleep(0.05)
    try:
        yield ServerHandle(config, app, f"http://127.0.0.1:{config.port}")
    finally:
        server.should_exit = True
        thread.join(30)


def server_config(model_dir: Path, data_dir: Path, redis_url: str | None, **overrides) -> ServerConfig:
    """The servers run `serve`'s default --engine-process unless $LORAPLEX_TEST_ENGINE_PROCESS names one
    (in-process or separate); a test that reads the in-process engine's objects (`.engine.engine`) asks
    for engine_process="in-process" itself, saying why."""
    base = ServerConfig.of(data_dir=data_dir, admin_token=ADMIN_TOKEN, model=str(model_dir), redis_url=redis_url,
                           port=free_port(), device="cpu", kv_cache_blocks=64,
                           max_model_len=512, max_loras=4, max_lora_rank=32,
                           max_num_batched_tokens=512, max_num_seqs=16)
    mode = os.environ.get("LORAPLEX_TEST_ENGINE_PROCESS")
    if mode:
        base = replace(base, engine_process=mode)
    return base.with_settings(**overrides)  # the server's fields and the engine's settings, by flat name


def api_redis_url(redis_server: EmbeddedRedis, flush: bool = True) -> str:
    url = redis_server.url_for(API_DB)
    if flush:
        client = redis.Redis.from_url(url)
        try:
            client.flushdb()
        finally:
            client.close()
    return url


@pytest.fixture(scope="module")
def api_server(tmp_path_factory, tiny_model_dir, redis_server, core_starter) -> Iterator[ServerHandle]:
    url = api_redis_url(redis_server)
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("api-data"), url,
                           rate_window_seconds=2.0)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def read_sse(url: str, headers: dict, body: dict, events: list, first: threading.Event) -> None:
    """POST a streaming request to `url` (run it on a thread): each `data:` payload goes to `events`,
    `first` is set at the first one, and "closed" is appended once the stream ended."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    events.append("closed")
