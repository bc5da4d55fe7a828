"""Adapters from sources, through the real server: vLLM's /v1/load_lora_adapter and unload, s3://
(moto's S3 server on loopback), http:// (a file server on loopback) and local references, lazy
first use, versions that follow the content, size and address refusals, LoRAX's adapter_id,
operator adapters shared by --lora-modules, and credentials that never come back out."""
from __future__ import annotations

import io
import logging
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.source_servers import FileServer, moto_s3

PROMPT = "Once upon a time"
BUCKET = "adapters"
SECRET = "sEcReT-adapter-source-credential-9f2c"
MAX_FILE = 1 << 20  # the server's cap on one fetched file (max_upload_bytes)
FILES = ("adapter_config.json", "adapter_model.safetensors")


def _files(adapter_dir) -> dict[str, bytes]:
    return {f: (adapter_dir / f).read_bytes() for f in FILES}


def _tar_gz(adapter_dir) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for f in FILES:
            tf.add(adapter_dir / f, arcname=f"adapter/{f}")
    return buf.getvalue()


@pytest.fixture(scope="module")
def s3_endpoint():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "loraplex-test-key-id")
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        mp.delenv("AWS_PROFILE", raising=False)
        with moto_s3() as url:
            boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
            yield url


@pytest.fixture(scope="module")
def s3(s3_endpoint):
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture(scope="module")
def files():
    with FileServer() as server:
        yield server


@pytest.fixture(scope="module")
def local_root(tmp_path_factory, tiny_adapters):
    root = tmp_path_factory.mktemp("adapter-root")
    for name, d in tiny_adapters.items():
        (root / name).mkdir()
        for f, data in _files(d).items():
            (root / name / f).write_bytes(data)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, tiny_adapters, redis_server, s3_endpoint, files, local_root, core_starter):
    config = server_config(
        tiny_model_dir, tmp_path_factory.mktemp("sources-data"), api_redis_url(redis_server),
        max_upload_bytes=MAX_FILE, adapter_sources=("s3", "http", "local"), adapter_local_root=str(local_root),
        adapter_s3_endpoint=s3_endpoint, adapter_s3_buckets=(BUCKET,), adapter_http_hosts=("127.0.0.1",),
        adapter_allow_private_networks=True, adapter_fetch_timeout=5.0, max_cpu_loras=8,
        lora_modules=(("shared-sql", str(tiny_adapters["r16_rslora"])),))
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _greedy(server, key, model, n=8, **extra) -> str:
    r = server.client(key).completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True, **extra})
    return r.choices[0].text


def _expected(server, tiny_model_dir, adapter_dir, peft_oracle, n=8) -> str:
    tok = server.tokenizer
    return tok.decode(peft_oracle(tiny_model_dir, adapter_dir, tok(PROMPT).input_ids, n))


def _version(server, key, name) -> str:
    with server.http(key) as h:
        r = h.get(f"/v1/adapters/{name}")
    assert r.status_code == 200, r.text
    return r.json()["version"]


def test_max_cpu_loras_is_room_for_that_many_adapters_of_max_rank(server):
    # tiny model: 2 layers; per layer, sum over the 7 projections of (in + out) = 1024; rank 32; float32
    assert server.state.engine.info.max_cpu_lora_bytes == 8 * 2 * 1024 * 32 * 4


def test_load_lora_adapter_as_vllm_documents_it(server, local_root, tiny_model_dir, tiny_adapters, peft_oracle):
    _, key = server.new_tenant()
    # vLLM's docs: POST {"lora_name", "lora_path"} with the key; then call the adapter by name.
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {key}"},
                   json={"lora_name": "sql_adapter", "lora_path": str(local_root / "r4_qv")})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql_adapter' added successfully."
    assert "sql_adapter" in [m.id for m in server.client(key).models.list().data]
    assert _greedy(server, key, "sql_adapter") == _expected(server, tiny_model_dir, tiny_adapters["r4_qv"],
                                                            peft_oracle)
    with server.http(key) as h:
        again = h.post("/v1/load_lora_adapter", json={"lora_name": "sql_adapter",
                                                      "lora_path": str(local_root / "r8_all")})
        assert again.status_code == 400 and "already been loaded" in again.text
        inplace = h.post("/v1/load_lora_adapter", json={"lora_name": "sql_adapter", "load_inplace": True,
                                                        "lora_path": str(local_root / "r8_all")})
        assert inplace.status_code == 200, inplace.text
    assert _greedy(server, key, "sql_adapter") == _expected(server, tiny_model_dir, tiny_adapters["r8_all"],
                                                            peft_oracle)
    with server.http(key) as h:
        # Outside the operator's root, by path or by a link out of it: refused, nothing fetched.
        outside = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tiny_adapters["r4_qv"])})
        assert outside.status_code == 403, outside.text
        dots = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(local_root / ".." / "x")})
        assert dots.status_code == 403, dots.text
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "hf://org/model"}).status_code == 400
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "a", "bogus": 1}).status_code == 400
        gone = h.post("/v1/unload_lora_adapter", json={"lora_name": "sql_adapter"})
        assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'sql_adapter' removed successfully."
        assert h.post("/v1/completions", json={"model": "sql_adapter", "prompt": "x"}).status_code == 404
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "sql_adapter"}).status_code == 404
    # Scoped to the caller: another tenant neither sees nor unloads what this one loads.
    _, other = server.new_tenant()
    with server.http(key) as h:
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": "r4_qv"}).status_code == 200
    with server.http(other) as h:
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 404
        assert h.post("/v1/completions", json={"model": "mine", "prompt": "x"}).status_code == 404


def test_s3_reference_is_lazy_and_versions_follow_the_object(server, s3, tiny_model_dir, tiny_adapters,
                                                             peft_oracle):
    _, key = server.new_tenant()
    for f, data in _files(tiny_adapters["r4_qv"]).items():
        s3.put_object(Bucket=BUCKET, Key=f"team/a1/{f}", Body=data)
    with server.http(key) as h:
        r = h.post("/v1/adapters", json={"name": "from-s3", "source": f"s3://{BUCKET}/team/a1"})
        assert r.status_code == 201, r.text
        assert r.json()["fetched"] is False and "version" not in r.json()
        assert h.get("/v1/adapters/from-s3").status_code == 404  # nothing fetched yet
    assert "from-s3" in [m.id for m in server.client(key).models.list().data]
    # The first use fetches it, validates it, stores it, and serves it.
    assert _greedy(server, key, "from-s3") == _expected(server, tiny_model_dir, tiny_adapters["r4_qv"], peft_oracle)
    v1 = _version(server, key, "from-s3")
    # Registered again over the same bytes: the version (what the KV cache is keyed on) stays.
    with server.http(key) as h:
        r = h.post("/v1/adapters", json={"name": "from-s3", "source": f"s3://{BUCKET}/team/a1", "replace": True,
                                         "prefetch": True})
        assert r.status_code == 201 and r.json()["version"] == v1, r.text
    for f, data in _files(tiny_adapters["r8_all"]).items():
        s3.put_object(Bucket=BUCKET, Key=f"team/a1/{f}", Body=data)
    with server.http(key) as h:
        r = h.post("/v1/adapters", json={"name": "from-s3", "source": f"s3://{BUCKET}/team/a1", "replace": True,
                                         "prefetch": True})
        assert r.status_code == 201 and r.json()["version"] != v1, r.text
    assert _greedy(server, key, "from-s3") == _expected(server, tiny_model_dir, tiny_adapters["r8_all"], peft_oracle)
    with server.http(key) as h:
        assert h.delete("/v1/adapters/from-s3").status_code == 200
        assert h.post("/v1/completions", json={"model": "from-s3", "prompt": "x"}).status_code == 404
        # Not there, not allowed, too large (from the object's size: nothing downloaded).
        missing = h.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": f"s3://{BUCKET}/nope"})
        assert missing.status_code == 404, missing.text
        other = h.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": "s3://other-bucket/a"})
        assert other.status_code == 403, other.text
        s3.put_object(Bucket=BUCKET, Key="big/adapter_config.json", Body=_files(tiny_adapters["r4_qv"])[FILES[0]])
        s3.put_object(Bucket=BUCKET, Key="big/adapter_model.safetensors", Body=b"\0" * (MAX_FILE + 1))
        big = h.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": f"s3://{BUCKET}/big"})
        assert big.status_code == 413 and f"{MAX_FILE + 1} bytes" in big.text, big.text
        assert "m" not in [m["id"] for m in h.get("/v1/models").json()["data"]]


def test_http_sources_directory_archive_and_redirects(server, files, tiny_model_dir, tiny_adapters, peft_oracle):
    _, key = server.new_tenant()
    for f, data in _files(tiny_adapters["r16_rslora"]).items():
        files.files[f"/dir/{f}"] = data
    files.files["/a.tar.gz"] = _tar_gz(tiny_adapters["r4_qv"])
    files.redirects["/moved.tar.gz"] = "/a.tar.gz"
    files.redirects["/escape.tar.gz"] = f"http://localhost:{files.port}/a.tar.gz"  # a host not allowed
    files.huge.add("/huge.tar")
    with server.http(key) as h:
        for name, path in (("dir", "/dir/"), ("tgz", "/a.tar.gz"), ("moved", "/moved.tar.gz")):
            r = h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": files.url + path})
            assert r.status_code == 200, r.text
        before = list(files.requests)
        escape = h.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": files.url + "/escape.tar.gz"})
        assert escape.status_code == 403 and "localhost" in escape.text, escape.text
        assert files.requests[len(before):] == ["/escape.tar.gz"]  # the forbidden hop was never requested
        huge = h.post("/v1/load_lora_adapter", json={"lora_name": "h", "lora_path": files.url + "/huge.tar"})
        assert huge.status_code == 413 and str(10 << 30) in huge.text, huge.text
        creds = h.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": f"http://u:pw@127.0.0.1:{files.port}/a.tar.gz"})
        assert creds.status_code == 400 and "pw" not in creds.text
    assert _greedy(server, key, "dir") == _expected(server, tiny_model_dir, tiny_adapters["r16_rslora"], peft_oracle)
    tgz = _expected(server, tiny_model_dir, tiny_adapters["r4_qv"], peft_oracle)
    assert _greedy(server, key, "tgz") == tgz and _greedy(server, key, "moved") == tgz


def test_a_slow_source_fails_its_own_registration_only(server, files):
    files.drip.add("/drip.tar")
    _, slow_key = server.new_tenant()
    _, other_key = server.new_tenant()
    with ThreadPoolExecutor(1) as pool, server.http(slow_key) as h:
        slow = pool.submit(h.post, "/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": files.url + "/drip.tar"})
        while "/drip.tar" not in files.requests:
            time.sleep(0.01)
        # Meanwhile the server answers everyone else (the fetch is off the event loop).
        assert _greedy(server, other_key, server.state.model_id, n=4)
        assert not slow.done()
        r = slow.result(60)
    assert r.status_code == 504 and "timed out" in r.text, r.text


def test_loopback_refused_unless_allowed(files, tiny_adapters):
    """The address check, with the operator's allowance off: no request reaches the server."""
    files.files["/only/adapter_config.json"] = b"{}"
    strict = SourcePolicy(kinds=frozenset({"http"}))
    before = len(files.requests)
    for url in (f"{files.url}/only/", f"http://localhost:{files.port}/only/", f"http://[::1]:{files.port}/only/",
                f"http://[::ffff:127.0.0.1]:{files.port}/only/"):
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(url), strict)
        assert e.value.status == 403, e.value.message
    assert len(files.requests) == before
    # Allowed: the same server answers (and the policy's other limits still hold).
    allowed = SourcePolicy(kinds=frozenset({"http"}), allow_private_networks=True)
    for f, data in _files(tiny_adapters["r4_qv"]).items():
        files.files[f"/ok/{f}"] = data
    got = fetch_adapter(parse_reference(f"{files.url}/ok/"), allowed)
    assert (got.config_json, got.weights) == tuple(_files(tiny_adapters["r4_qv"]).values())
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference(f"{files.url}/ok/"), SourcePolicy(kinds=frozenset({"s3"})))
    assert e.value.status == 403


def test_lorax_adapter_id(server, s3, tiny_model_dir, tiny_adapters, peft_oracle):
    _, key = server.new_tenant()
    assert server.upload(key, "named", tiny_adapters["r4_qv"]).status_code == 201
    base = server.state.model_id
    r4 = _expected(server, tiny_model_dir, tiny_adapters["r4_qv"], peft_oracle)
    assert _greedy(server, key, base, adapter_id="named") == r4
    for f, data in _files(tiny_adapters["r8_all"]).items():
        s3.put_object(Bucket=BUCKET, Key=f"lorax/r8/{f}", Body=data)
    r8 = _expected(server, tiny_model_dir, tiny_adapters["r8_all"], peft_oracle)
    assert _greedy(server, key, base, adapter_id=f"{BUCKET}/lorax/r8", adapter_source="s3") == r8
    assert _greedy(server, key, base, adapter_id=f"s3://{BUCKET}/lorax/r8", adapter_source="s3") == r8
    with server.http(key) as h:
        def post(**body):
            return h.post("/v1/completions", json={"model": base, "prompt": "x", "max_tokens": 2, **body})
        assert post(adapter_id="nope").status_code == 404
        assert post(adapter_id="org/model", adapter_source="hub").status_code == 400
        assert post(adapter_source="s3").status_code == 400
        assert h.post("/v1/completions", json={"model": "named", "prompt": "x", "adapter_id": "other"}).status_code == 400
        chat = h.post("/v1/chat/completions", json={"model": base, "adapter_id": "named", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text


def test_lora_modules_shared_with_the_tenants_the_admin_names(server, tiny_model_dir, tiny_adapters, peft_oracle):
    a_name, a_key = server.new_tenant()
    b_name, b_key = server.new_tenant()
    expected = _expected(server, tiny_model_dir, tiny_adapters["r16_rslora"], peft_oracle)
    for key in (a_key, b_key):  # shared with all at first start
        assert "shared-sql" in [m.id for m in server.client(key).models.list().data]
    r = server.admin("PUT", "/admin/shared-adapters/shared-sql", json={"tenants": [a_name]})
    assert r.status_code == 200 and r.json()["tenants"] == [a_name], r.text
    assert _greedy(server, a_key, "shared-sql") == expected
    assert "shared-sql" in [m.id for m in server.client(a_key).models.list().data]
    assert "shared-sql" not in [m.id for m in server.client(b_key).models.list().data]
    with server.http(b_key) as h:
        assert h.post("/v1/completions", json={"model": "shared-sql", "prompt": "x"}).status_code == 404
        # B may have its own adapter of that name: the share it cannot see does not get in the way.
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "shared-sql", "lora_path": "r4_qv"}).status_code == 200
    assert _greedy(server, b_key, "shared-sql") == _expected(server, tiny_model_dir, tiny_adapters["r4_qv"],
                                                             peft_oracle)
    with server.http(a_key) as h:  # read-only to the tenants it is shared with, outside their quota
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "shared-sql"}).status_code == 403
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "shared-sql", "lora_path": "r4_qv"}).status_code == 403
        assert h.get("/v1/usage").status_code == 200
    listing = server.admin("GET", "/admin/shared-adapters").json()["data"]
    assert [(d["name"], d["tenants"]) for d in listing] == [("shared-sql", [a_name])]
    assert server.admin("PUT", "/admin/shared-adapters/nope", json={"tenants": "all"}).status_code == 404
    assert server.admin("PUT", "/admin/shared-adapters/shared-sql", json={"tenants": ["no-such"]}).status_code == 404
    with server.http(a_key) as h:
        assert h.put("/admin/shared-adapters/shared-sql", json={"tenants": "all"}).status_code == 403
    assert server.admin("PUT", "/admin/shared-adapters/shared-sql", json={"tenants": "all"}).status_code == 200
    assert "shared-sql" in [m.id for m in server.client(b_key).models.list().data]


def test_credentials_never_come_back_out(server, s3, caplog):
    _, key = server.new_tenant()
    bodies = []
    with caplog.at_level(logging.DEBUG), server.http(key) as h:
        for path in ("s3://missing-bucket/x", f"s3://{BUCKET}/nope", f"s3://{BUCKET}/big"):
            bodies.append(h.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": path}).text)
        bodies.append(h.get("/v1/models").text)
        bodies.append(h.get("/v1/adapters").text)
    bodies.append(server.admin("GET", "/metrics").text)
    bodies.append(server.admin("GET", "/admin/shared-adapters").text)
    for text in bodies:
        assert SECRET not in text and "loraplex-test-key-id" not in text
    # The secret key is in no log line at any level; botocore's own DEBUG lines show the access key
    # id (in the signed Authorization header), so the id is checked at the levels a server logs at.
    assert SECRET not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "loraplex-test-key-id" in r.getMessage()]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_router_metrics_match_the_engine(server, tiny_adapters):
    a_name, a_key = server.new_tenant()
    a_id = server.admin("GET", f"/admin/tenants/{a_name}").json()["id"]
    names = sorted(tiny_adapters)
    for name in names:
        assert server.upload(a_key, name, tiny_adapters[name]).status_code == 201
    expected = {f"{a_id}/{n}" for n in names} | {"shared-sql"}  # 5 adapters, max_loras 4: one waits
    client = server.client(a_key)

    def generate(model: str) -> None:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0,
                                  extra_body={"ignore_eos": True})

    with server.engine_throttled(0.05), ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(generate, m) for m in names + ["shared-sql"]]
        with server.engine_paused_once(lambda s: s.running >= 1 and s.running + s.waiting == 5,
                                       "the requests never reached the engine"):
            stats = server.state.engine.stats()
            families = _families(server.admin("GET", "/metrics").text)
        for f in futures:
            f.result(60)
    model = server.state.model_id
    value = {name: {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}
             for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")}
    assert value["vllm:num_requests_waiting"] == {(("model_name", model),): stats.scheduler.waiting}
    assert value["vllm:num_requests_running"] == {(("model_name", model),): stats.scheduler.running}
    assert value["vllm:kv_cache_usage_perc"] == {(("model_name", model),):
                                                 pytest.approx(stats.kv_blocks.used / stats.kv_blocks.total)}
    [info] = families["vllm:lora_requests_info"].samples
    running = set(filter(None, info.labels["running_lora_adapters"].split(",")))
    waiting = set(filter(None, info.labels["waiting_lora_adapters"].split(",")))
    assert info.labels["max_lora"] == "4" and abs(info.value - time.time()) < 120
    assert 1 <= len(running) <= 4 and running | waiting == expected and not running & waiting
    label = {f"{a_id}/{r.name}": r.version for r in server.state.registry.list(a_id)}
    label["shared-sql"] = server.state.registry.get("~operator", "shared-sql").version
    assert {label[n] for n in running} == stats.scheduler.running_adapters
    assert {label[n] for n in waiting} == stats.scheduler.waiting_adapters
    # Behind the metrics credential: a tenant key is refused.
    with server.http(a_key) as h:
        assert h.get("/metrics").status_code == 403


def test_references_count_against_max_adapters_and_go_with_their_tenant(server, s3, tiny_adapters):
    name, key = server.new_tenant(quota={"max_adapters": 1})
    tenant_id = server.admin("GET", f"/admin/tenants/{name}").json()["id"]
    for f, data in _files(tiny_adapters["r4_qv"]).items():
        s3.put_object(Bucket=BUCKET, Key=f"quota/one/{f}", Body=data)
    with server.http(key) as h:
        first = h.post("/v1/adapters", json={"name": "one", "source": f"s3://{BUCKET}/quota/one"})
        assert first.status_code == 201, first.text
        second = h.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": "r4_qv", "prefetch": False})
        assert second.status_code == 403 and "max_adapters" in second.text, second.text
        # A replacement whose fetch fails leaves the adapter as it was; a failed first one, nothing.
        failed = h.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": f"s3://{BUCKET}/nope",
                                                       "load_inplace": True})
        assert failed.status_code == 404
        assert server.state.references.get(tenant_id, "one").source == f"s3://{BUCKET}/quota/one"
        assert h.post("/v1/completions", json={"model": "one", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "one"}).status_code == 200
        failed = h.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": f"s3://{BUCKET}/nope"})
        assert failed.status_code == 404 and server.state.references.get(tenant_id, "one") is None
    assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    assert server.state.references.list(tenant_id) == {}
