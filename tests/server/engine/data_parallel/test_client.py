"""DataParallelEngineClient over stand-in cores (the real ones: tests/server/api/test_api_data_parallel.py):
a request's end frees its core's seat at once, however its stream ends; a pin holds on every core or
on none; residency and tiers are the cores' best and union; health is any core's, a gone core ends it."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from server.engine.data_parallel.client import DataParallelEngineClient
from server.engine.data_parallel.router import Router
from server.engine.protocol.residency import AdapterTiers
from server.engine.protocol.request import EngineRequest
from server.engine.sequence import SamplingParams

pytestmark = pytest.mark.unit


@dataclass
class Out:
    finished: bool


class Stream:
    def __init__(self, request_id: str, outputs: list) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self.aborted = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._outputs:
            raise StopAsyncIteration
        item = self._outputs.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        self.aborted = True

    async def aclose(self) -> None:
        self.abort()


@dataclass
class Sched:
    running: int = 0
    waiting: int = 0
    running_adapters: frozenset = frozenset()
    waiting_adapters: frozenset = frozenset()


@dataclass
class Info:
    max_num_seqs: int = 4
    max_loras: int = 2


@dataclass
class Core:
    """What the DP client reads of a RemoteEngineClient."""

    pins_allowed: bool = True
    device: list = field(default_factory=list)
    host: list = field(default_factory=list)
    is_healthy: bool = True
    is_restarting: bool = False
    gave_up: bool = False
    error: str | None = None
    restarts: int = 0
    refused_messages: int = 0
    info: Info = field(default_factory=Info)
    pinned: set = field(default_factory=set)
    outputs: list = field(default_factory=list)
    published: Sched | None = None  # the scheduler part of the core's last stats push
    snapshot_at: float = 0.0

    async def submit(self, request):
        return Stream(request.request_id, list(self.outputs))

    async def pin_adapter(self, version, tenant):
        if self.pins_allowed:
            self.pinned.add(version)
        return self.pins_allowed

    async def unpin_adapter(self, version):
        had = version in self.pinned
        self.pinned.discard(version)
        return had

    async def adapter_residency(self):
        return {**{v: "host" for v in self.host}, **{v: "device" for v in self.device}}

    async def adapter_tiers(self):
        return AdapterTiers(sorted(self.device), sorted(self.host))

    def adapter_tiers_future(self):
        done = concurrent.futures.Future()
        done.set_result(AdapterTiers(sorted(self.device), sorted(self.host)))
        return done

    def stats(self):
        assert self.published is not None, "not read while stats are not needed"
        return SimpleNamespace(scheduler=self.published)

    def shutdown(self):
        pass


def _request(rid: str, n: int = 1) -> EngineRequest:
    return EngineRequest(rid, [1, 2], SamplingParams(n=n, max_tokens=2))


@pytest.fixture()
def make():
    """The client's state without its residency thread or the cores' EngineInfo (the stand-ins have none)."""
    def build(*cores: Core) -> DataParallelEngineClient:
        client = DataParallelEngineClient.__new__(DataParallelEngineClient)
        client.cores, client.router = list(cores), Router("round-robin")
        client._in_flight, client.routed = [0] * len(cores), [0] * len(cores)
        client._accepted = [{} for _ in cores]
        client._device, client._placed = [frozenset()] * len(cores), [{} for _ in cores]
        return client

    return build


def test_a_seat_is_freed_when_the_stream_ends_errs_or_is_aborted(make, monkeypatch):
    a, b = Core(outputs=[Out(False), Out(True)]), Core(outputs=[RuntimeError("core died")])
    client = make(a, b)
    monkeypatch.setattr(client, "views", lambda: [])
    monkeypatch.setattr(client.router, "choose", lambda version, views: 0)

    async def go():
        stream = await client.submit(_request("r1"))
        assert client._in_flight == [1, 0]
        assert [out.finished async for out in stream] == [False, True]
        assert client._in_flight == [0, 0]
        client.router.choose = lambda version, views: 1
        stream = await client.submit(_request("r2"))
        with pytest.raises(RuntimeError):
            await stream.__anext__()
        assert client._in_flight == [0, 0]
        stream = await client.submit(_request("r3"))
        stream.abort()
        stream.abort()
        assert client._in_flight == [0, 0] and client.routed == [1, 2]

    asyncio.run(go())


def test_the_load_is_what_each_core_published_plus_this_front_ends_unpublished_requests(make):
    """With several front ends a core's load is mostly other front ends' requests: the router reads the
    core's own running and waiting counts, adds what this client had accepted there since that push,
    and never goes below its own requests still running there."""
    busy = Core(published=Sched(running=3, waiting=2), snapshot_at=time.monotonic())
    idle = Core(published=Sched(), snapshot_at=time.monotonic(), outputs=[Out(False)])
    client = make(busy, idle)
    client.router = Router("affinity")
    assert [v.in_flight for v in client.views()] == [5, 0]  # nothing of them sent by this client

    async def go():
        first = await client.submit(_request("r1"))  # to the idle core: the busy one is the other front end's
        assert client._in_flight == [0, 1]
        assert [v.in_flight for v in client.views()] == [5, 1]  # accepted after idle's last push
        idle.published, idle.snapshot_at = Sched(running=1), time.monotonic()
        assert [v.in_flight for v in client.views()] == [5, 1]  # now in the push: not counted twice
        idle.published = Sched()  # a push that lags this client's own count
        assert [v.in_flight for v in client.views()] == [5, 1]
        return first

    asyncio.run(go())
    assert client.routed == [0, 1]


def test_a_pin_holds_on_every_core_or_none(make):
    ok, refuses = Core(), Core(pins_allowed=False)
    client = make(ok, refuses)
    assert asyncio.run(client.pin_adapter("v1", "acme")) is False
    assert ok.pinned == set() and refuses.pinned == set()
    both = make(Core(), Core())
    assert asyncio.run(both.pin_adapter("v1", "acme")) is True
    assert [c.pinned for c in both.cores] == [{"v1"}, {"v1"}]
    assert asyncio.run(both.unpin_adapter("v1")) is True


def test_residency_is_the_fastest_tier_of_any_core_and_tiers_their_union(make):
    client = make(Core(device=["a"], host=["b"]), Core(device=["b"], host=["c"]))
    assert asyncio.run(client.adapter_residency()) == {"a": "device", "b": "device", "c": "host"}
    assert asyncio.run(client.adapter_tiers()) == AdapterTiers(["a", "b"], ["b", "c"])


def test_healthy_while_any_core_serves_and_over_once_one_is_gone(make):
    dead, alive = Core(is_healthy=False, is_restarting=True, error="exited"), Core()
    client = make(dead, alive)
    assert client.is_healthy and not client.is_restarting and client.error == "engine core 0: exited"
    alive.is_healthy = False
    assert not client.is_healthy and client.is_restarting
    dead.gave_up = True
    assert not client.is_healthy and not client.is_restarting and client.gave_up


def test_the_summed_info_adds_the_unified_pools_units_as_the_stats_add_their_uses(tiny_model_dir):
    """/admin/engine's memory_pool reads the units from the info and their uses from the summed stats:
    one core's units beside two cores' uses gave negative free units."""
    from dataclasses import replace

    from adapters.format import ModelShape
    from server.engine.config import ModelConfig
    from server.engine.data_parallel.client import _summed_info
    from server.engine.kv_cache import KvPoolInfo
    from server.engine.protocol.info import EngineInfo
    from server.engine.unified_memory import UnifiedPool

    pool = KvPoolInfo("float32", blocks=40, block_size=16, bytes=4000, unified=UnifiedPool.of(32, 100, 150, 4))
    one = EngineInfo(max_model_len=256, vocab_size=64, adapter_shape=ModelShape(1, 8, 8, 8, 16), max_loras=2,
                     max_lora_rank=16, max_num_seqs=4, max_cpu_lora_bytes=None, device="cpu", dtype="float32",
                     dtype_bytes=4, kv_pool=pool, requested_kv_cache_dtype="auto", block_size=16,
                     async_scheduling=False, base_weights={}, model_config=ModelConfig.from_dir(tiny_model_dir))
    summed = _summed_info([one, replace(one)]).kv_pool
    assert (summed.blocks, summed.bytes) == (80, 8000)
    assert summed.unified == UnifiedPool(units=80, unit_bytes=100, units_per_page=2, kv_share=64, adapter_share=16)
