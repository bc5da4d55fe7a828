"""--engine-process separate: the engine core in its own process gives, over HTTP, exactly the
in-process server's outputs (completions and chat, streamed and not, a concurrent mix of adapters,
logprobs and a JSON-schema constraint whose compiled grammar crosses to the core); a kill -9 of the
core mid-stream ends the stream with an SSE error event, /health turns 503 within about a second,
new requests get 503 with Retry-After, and `loraplex serve` exits with status 1."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.bench.server_proc import ServerProcess
from server.demo import make_base_model
from server.engine.core.process import PROCESS_NAME as CORE_PROCESS_NAME
from tests.fixtures_server import api_redis_url, read_sse, running_server, server_config

ADAPTERS = ("r4_qv", "r8_all", "r16_rslora")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def both_servers(tmp_path_factory, tiny_model_dir, tiny_adapters, redis_server, core_starter):
    """(in-process, separate) servers on one Redis database, under their own key prefixes, each with a
    tenant that uploaded the same adapters."""
    url = api_redis_url(redis_server)
    base = server_config(tiny_model_dir, tmp_path_factory.mktemp("split-data"), url)
    with contextlib.ExitStack() as stack:
        handles = []
        for mode in ("in-process", "separate"):
            config = replace(base, engine_process=mode, redis_prefix=f"lp-{mode}:", port=_port(),
                             data_dir=tmp_path_factory.mktemp(f"data-{mode}"))
            handle = stack.enter_context(running_server(config, starter=core_starter))
            _, key = handle.new_tenant()
            for name in ADAPTERS:
                assert handle.upload(key, name, tiny_adapters[name]).status_code == 201
            handles.append((handle, key))
        yield handles


def _port() -> int:
    from server.embedded_redis.server import free_port
    return free_port()


def _same(a, b) -> bool:
    """Equal, tokens and text exactly; logprobs to 1e-4 (a batch of another make-up rounds a float32 matmul
    differently: the same happens between two runs of one server)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _requests() -> list[tuple[str, dict]]:
    out = []
    for i, model in enumerate((None, *ADAPTERS)):
        for stream in (False, True):
            common = {"max_tokens": 12, "temperature": 0, "stream": stream, **({"model": model} if model else {})}
            out.append(("/v1/completions", {**common, "prompt": f"story {i}", "logprobs": 2, "ignore_eos": True}))
            out.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"hi {i}"}],
                                                 "logprobs": True, "top_logprobs": 2}))
    out.append(("/v1/completions", {"prompt": "json", "max_tokens": 20, "temperature": 0, "model": ADAPTERS[0],
                                    "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": SCHEMA}}}))
    out.append(("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.8, "seed": 7, "n": 3}))
    return out


def _answer(handle, key: str, path: str, body: dict):
    """The response with its ids and times removed: for a stream, its events' choices in order."""
    body = dict(body)
    body.setdefault("model", handle.state.model_id)
    with handle.http(key) as h:
        if not body.get("stream"):
            r = h.post(path, json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            usage.pop("prompt_tokens_details", None)  # cached tokens: which concurrent prompt came first
            return r.json()["choices"], usage
        choices: dict[int, dict] = {}
        with h.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        _merge(choices.setdefault(choice["index"], {"text": "", "logprobs": {}}), choice)
        return choices


def _merge(into: dict, choice: dict) -> None:
    """A stream's chunks are cut where the front end happened to read: compare what they add up to."""
    into["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    for field, values in (choice.get("logprobs") or {}).items():
        into["logprobs"].setdefault(field, []).extend(values or [])
    into["finish_reason"] = choice.get("finish_reason") or into.get("finish_reason")


def test_split_outputs_equal_in_process_outputs_token_for_token(both_servers):
    requests = _requests()
    answers = []
    for handle, key in both_servers:
        with ThreadPoolExecutor(len(requests)) as pool:  # concurrent: one mixed batch of adapters
            answers.append(list(pool.map(lambda r: _answer(handle, key, *r), requests)))
    for request, in_process, separate in zip(requests, *answers):
        assert _same(separate, in_process), (request, in_process, separate)
    constrained = answers[1][-2][0][0]["text"]  # the random model is held to the schema (it may not finish)
    assert constrained.replace(" ", "").startswith('{"a":'), constrained


def test_split_server_reports_its_engine(both_servers):
    handle, key = both_servers[1]
    with handle.http(key) as h:
        assert h.get("/health").json()["engine"] is True
    admin = handle.admin("GET", "/admin/engine")
    assert admin.status_code == 200, admin.text
    deadline = time.monotonic() + 2  # the core pushes its snapshot every 0.25 s
    while handle.state.engine.snapshot().stats.scheduler.running or handle.state.engine.stats().scheduler.waiting:
        assert time.monotonic() < deadline, handle.state.engine.snapshot()
        time.sleep(0.05)


def test_split_server_exports_adapter_residency(both_servers):
    """The residency series and load histograms of /metrics come from the core: where adapters are, by a
    command between its steps; the load durations with its Stats pushes."""
    handle, key = both_servers[1]
    for name in ADAPTERS:
        handle.client(key).completions.create(model=name, prompt="hi", max_tokens=2, temperature=0)
    deadline = time.monotonic() + 5
    while True:
        stats = handle.state.engine.stats()
        text = handle.admin("GET", "/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        levels = [s.labels["level"] for s in families["vllm:lora_adapter_loaded"].samples]
        counts = {s.labels["level"]: s.value for s in families["vllm:lora_adapter_load_seconds"].samples
                  if s.name.endswith("_count")}
        if (levels.count("gpu"), levels.count("cpu"), counts.get("cpu"), counts.get("gpu")) == (
                stats.slots.resident, stats.host.adapters, stats.host.loads, stats.slots.loads):
            break
        assert time.monotonic() < deadline, (levels, counts, stats)
        time.sleep(0.1)
    assert stats.slots.resident == len(ADAPTERS) and stats.host.loads >= len(ADAPTERS)


@contextlib.contextmanager
def _cli_split_server(redis_server, tmp_path, *flags: str):
    """`loraplex serve --engine-process separate` on a model with room for long streams: (server, a tenant's
    auth header, the model id, the engine-core process)."""
    model_dir = make_base_model(tmp_path / "model", "llama", hidden_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, intermediate_size=128, max_position_embeddings=8192)
    serve_args = ["--redis-url", api_redis_url(redis_server), "--device", "cpu", "--kv-cache-blocks", "520",
                  "--max-model-len", "8192", "--engine-process", "separate", "--model", str(model_dir), *flags]
    with ServerProcess(tmp_path / "data", tmp_path / "serve.log", model_dir=None, serve_args=serve_args) as srv:
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        assert httpx.post(f"{srv.url}/admin/tenants", headers=admin, json={"name": "k", "quota": {}}).status_code == 201
        key = httpx.post(f"{srv.url}/admin/tenants/k/keys", headers=admin).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        model = httpx.get(f"{srv.url}/v1/models", headers=auth).json()["data"][0]["id"]
        core = [p for p in psutil.Process(srv.proc.pid).children() if p.name() == CORE_PROCESS_NAME]
        assert len(core) == 1
        yield srv, auth, model, core[0]


def _stream_on_thread(srv, auth: dict, body: dict) -> tuple[threading.Thread, list, threading.Event]:
    events, first = [], threading.Event()
    reader = threading.Thread(target=read_sse, args=(f"{srv.url}/v1/completions", auth, body, events, first),
                              daemon=True)
    reader.start()
    assert first.wait(60)
    return reader, events, first


def test_kill_9_of_the_core_mid_stream(redis_server, tmp_path):
    with _cli_split_server(redis_server, tmp_path, "--no-engine-restart") as (srv, auth, model, core):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        reader, events, _ = _stream_on_thread(srv, auth, body)
        core.kill()
        killed = time.monotonic()
        while httpx.get(f"{srv.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 1.5, "/health still 200"
            time.sleep(0.02)
        reader.join(10)
        assert events[-1] == "closed" and events[-2] == "[DONE]", events[-3:]
        assert json.loads(events[-3])["error"]["code"] == "engine_unavailable"
        r = httpx.post(f"{srv.url}/v1/completions", headers=auth, json={"model": model, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert srv.proc.wait(30) == 1


def test_sigterm_to_server_and_core_drains_both(redis_server, tmp_path):
    """As systemd stops a service (SIGTERM to every process of its group): the running stream finishes
    with all its tokens, the server exits 0 and the core after it."""
    with _cli_split_server(redis_server, tmp_path) as (srv, auth, model, core):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        reader, events, _ = _stream_on_thread(srv, auth, body)
        core.terminate()
        srv.proc.terminate()
        reader.join(60)
        assert events[-2] == "[DONE]" and json.loads(events[-3])["choices"][0]["finish_reason"] == "length", \
            events[-3:]
        assert srv.proc.wait(60) == 0
        core.wait(30)
