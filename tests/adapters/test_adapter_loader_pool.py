"""Cold loads in loader processes (adapters.loader_pool): the same bytes, summary and weights as the
in-process path, from moto's S3 server on loopback; and, through the real server with an HTTP file
server on loopback whose paths drip, a loader killed with SIGKILL mid-load fails that load alone
(the next load works), and one tenant's fetches stay within its bound while another tenant's load
goes through."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import boto3
import pytest
import torch

from adapters.format import AdapterFormatError, ModelShape, inspect_adapter_bytes, load_adapter_bytes
from adapters.loader_pool import LoaderError, LoaderPool
from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.source_servers import FileServer, moto_s3

FILES = ("adapter_config.json", "adapter_model.safetensors")
PROMPT = "Once upon a time"


def _serve_files(files: FileServer, prefix: str, adapter_dir) -> None:
    for f in FILES:
        files.files[f"/{prefix}/{f}"] = (adapter_dir / f).read_bytes()


def test_a_cold_load_in_a_loader_process_gives_what_the_server_process_would(tiny_model_dir, tiny_adapters,
                                                                            tiny_dora_adapters, monkeypatch):
    adapters = {**tiny_adapters, **tiny_dora_adapters}
    shape = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "loader-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "loader-test-secret")
    pool = LoaderPool(1, 1 << 20)
    try:
        with moto_s3() as endpoint:
            s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            s3.create_bucket(Bucket="bkt")
            for name in ("r4_qv", "r16_rslora", "dora_r8_all"):
                for f in FILES:
                    s3.put_object(Bucket="bkt", Key=f"{name}/{f}", Body=(adapters[name] / f).read_bytes())
            policy = SourcePolicy(kinds=frozenset({"s3"}), s3_endpoint=endpoint)
            for name in ("r4_qv", "r16_rslora", "dora_r8_all"):
                ref = f"s3://bkt/{name}"
                loaded = pool.load(ref, policy, None, shape, 32)
                if name == "r4_qv":
                    loaded_first = loaded
                files = fetch_adapter(parse_reference(ref), policy)
                summary = inspect_adapter_bytes(files.config_json, files.weights, shape, 32)
                assert loaded.summary == summary  # rank, modules, size and the canonical config bytes
                assert loaded.weights == files.weights and loaded.sha256 == files.sha256
                # The host tier's page-in of the stored bytes, parsed in a loader process: the same tensors.
                ours = pool.parse(loaded.summary.canonical_config_json, loaded.weights, shape, 32, name)
                theirs = load_adapter_bytes(summary.canonical_config_json, files.weights, shape, 32)
                assert ours.weights.keys() == theirs.weights.keys() and dict(ours.config) == dict(theirs.config)
                assert (ours.rank, ours.target_modules, ours.use_rslora, ours.size_bytes) == \
                    (theirs.rank, theirs.target_modules, theirs.use_rslora, theirs.size_bytes)
                for slot, w in theirs.weights.items():
                    assert torch.equal(ours.weights[slot].a, w.a) and torch.equal(ours.weights[slot].b, w.b)
                    assert ours.weights[slot].scaling == w.scaling
                    assert (ours.weights[slot].magnitude is None) == (w.magnitude is None)
                    assert w.magnitude is None or torch.equal(ours.weights[slot].magnitude, w.magnitude)
                assert ours.use_dora == (name == "dora_r8_all")
            # The source's refusals come back as they are: missing (404), a bucket not allowed (403).
            with pytest.raises(SourceError) as missing:
                pool.load("s3://bkt/nope", policy, None, shape, 32)
            assert missing.value.status == 404
            with pytest.raises(SourceError) as refused:
                pool.load("s3://other/x", SourcePolicy(kinds=frozenset({"s3"}), s3_endpoint=endpoint,
                                                       s3_buckets=frozenset({"bkt"})), None, shape, 32)
            assert refused.value.status == 403
            # A stored version that no longer validates is refused by the page-in as in the server process.
            with pytest.raises(AdapterFormatError):
                pool.parse(loaded.summary.canonical_config_json, loaded.weights[:-8], shape, 32, "cut")
            assert pool.restarts == 0
            # A loader that died while idle (the OOM killer) fails the load that finds it so, and only that one.
            [pid] = pool.pids()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(LoaderError) as died:
                pool.load("s3://bkt/r4_qv", policy, None, shape, 32)
            assert died.value.status == 502 and "signal 9" in died.value.message
            assert pool.load("s3://bkt/r4_qv", policy, None, shape, 32).weights == loaded_first.weights
            assert pool.restarts == 1
    finally:
        pool.close()


@pytest.fixture(scope="module")
def files():
    with FileServer() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, files, core_starter):
    config = server_config(
        tiny_model_dir, tmp_path_factory.mktemp("loader-data"), api_redis_url(redis_server),
        max_upload_bytes=2 << 20, adapter_sources=("http",), adapter_http_hosts=("127.0.0.1",),
        adapter_allow_private_networks=True, adapter_fetch_timeout=4.0,
        adapter_load_workers=2, adapter_loads_per_tenant=1)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _greedy(server, key, model) -> str:
    r = server.client(key).completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    return r.choices[0].text


def _expected(server, tiny_model_dir, adapter_dir, peft_oracle) -> str:
    tok = server.tokenizer
    # The server skips special tokens in the text (vLLM's default), an EOS among the 8 included.
    return tok.decode(peft_oracle(tiny_model_dir, adapter_dir, tok(PROMPT).input_ids, 8), skip_special_tokens=True)


def _drip_requests(files: FileServer, prefix: str) -> int:
    return sum(1 for p in list(files.requests) if p.startswith(prefix))


def test_a_loader_killed_mid_load_fails_that_load_alone_and_the_next_load_works(server, files, tiny_model_dir,
                                                                                tiny_adapters, peft_oracle):
    _, key = server.new_tenant()
    files.drip.add("/killed/adapter_config.json")
    _serve_files(files, "good", tiny_adapters["r8_all"])
    result: dict = {}

    def slow_load() -> None:
        with server.http(key) as h:
            result["r"] = h.post("/v1/load_lora_adapter",
                                 json={"lora_name": "doomed", "lora_path": f"{files.url}/killed/"})

    t = threading.Thread(target=slow_load)
    t.start()
    deadline = time.monotonic() + 30
    while not server.state.loaders.busy_pids() or not _drip_requests(files, "/killed/"):
        assert time.monotonic() < deadline, "the load never reached a loader process"
        time.sleep(0.02)
    [pid] = server.state.loaders.busy_pids()
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    r = result["r"]
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_loader_crashed" and "signal 9" in error["message"], error
    assert server.state.loaders.restarts == 1 and pid not in server.state.loaders.pids()
    # Nothing of the failed load stays; the next load (it may get the new process) works and serves exactly.
    with server.http(key) as h:
        assert h.post("/v1/completions", json={"model": "doomed", "prompt": "x"}).status_code == 404
        for name in ("after1", "after2"):  # two loads: whichever process each gets, both work
            ok = h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"{files.url}/good/"})
            assert ok.status_code == 200, ok.text
    assert _greedy(server, key, "after2") == _expected(server, tiny_model_dir, tiny_adapters["r8_all"], peft_oracle)


def test_one_tenants_fetches_stay_within_its_bound_and_another_tenant_still_gets_a_loader(
        server, files, tiny_adapters):
    slow_tenant, slow_key = server.new_tenant()
    _, other_key = server.new_tenant()
    for i in range(3):
        files.drip.add(f"/bound{i}/adapter_config.json")
    _serve_files(files, "quick", tiny_adapters["r4_qv"])
    with server.http(slow_key) as h:  # registered lazily: each first use is a fetch
        for i in range(3):
            r = h.post("/v1/adapters", json={"name": f"slow{i}", "source": f"{files.url}/bound{i}/"})
            assert r.status_code == 201, r.text
    statuses: list[int] = []

    def use(i: int) -> None:
        with server.http(slow_key) as h:
            statuses.append(h.post("/v1/completions", json={"model": f"slow{i}", "prompt": "x",
                                                            "max_tokens": 1}).status_code)

    tenant_id = server.admin("GET", f"/admin/tenants/{slow_tenant}").json()["id"]
    seen: list[int] = []  # the slow tenant's fetches under way, sampled until its requests end
    threads = [threading.Thread(target=use, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()

    def sample() -> None:
        while any(t.is_alive() for t in threads):
            seen.append(server.state.fetches.running.get(tenant_id, 0))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    deadline = time.monotonic() + 30
    while not _drip_requests(files, "/bound"):
        assert time.monotonic() < deadline, "no fetch of the slow tenant started"
        time.sleep(0.02)
    # The slow tenant keeps one fetch under way (its bound) though a second loader process is idle:
    # another tenant's load takes that one and finishes while the slow tenant's fetches still drip.
    with server.http(other_key) as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "quick", "lora_path": f"{files.url}/quick/"})
    assert r.status_code == 200, r.text
    assert len(statuses) < 3, "the other tenant's load waited for the slow tenant's fetches"
    for t in threads:
        t.join(60)
    sampler.join(5)
    # Each slow fetch ran on its own, one after another, and timed out as the source policy says.
    assert max(seen) == 1 and statuses == [504, 504, 504] and _drip_requests(files, "/bound") == 3
