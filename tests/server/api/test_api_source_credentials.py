"""A tenant's own S3 credentials, through the real server against moto's S3 server with IAM
authentication on: the tenant that set valid keys loads from the bucket, others fall back to the
server's keys (which this store rejects), a wrong secret fails, and the secret never comes back out
(responses, logs, /metrics, Redis). The sealed value is bound to its tenant."""
from __future__ import annotations

import json
import logging

import boto3
import pytest
import redis

from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.source_servers import moto_s3

BUCKET = "tenant-bucket"
SERVER_SECRET = "server-chain-secret-not-in-this-store"
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def store(tiny_adapters):
    """(endpoint, an IAM access key allowed to read the bucket) of a moto S3 that checks signatures."""
    import moto.settings

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "AKIASERVERCHAIN0000")
        mp.setenv("AWS_SECRET_ACCESS_KEY", SERVER_SECRET)
        mp.delenv("AWS_PROFILE", raising=False)
        with moto_s3() as url:
            iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1")
            iam.create_user(UserName="tenant-a")
            iam.put_user_policy(UserName="tenant-a", PolicyName="read", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
            access = iam.create_access_key(UserName="tenant-a")["AccessKey"]
            s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
            s3.create_bucket(Bucket=BUCKET)
            for f in FILES:
                s3.put_object(Bucket=BUCKET, Key=f"r4/{f}", Body=(tiny_adapters["r4_qv"] / f).read_bytes())
            mp.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # every request signed from here on
            yield url, access["AccessKeyId"], access["SecretAccessKey"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, store, core_starter):
    url, _, _ = store
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("srccred"), api_redis_url(redis_server),
                           adapter_sources=("s3",), adapter_s3_endpoint=url, adapter_s3_buckets=(BUCKET,),
                           adapter_fetch_timeout=10.0)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _put(server, key, body):
    with server.http(key) as h:
        return h.put("/v1/adapter_source_credentials/s3", json=body)


def _load(server, key, name):
    with server.http(key) as h:
        return h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"s3://{BUCKET}/r4"})


def test_a_tenants_own_keys_load_from_its_bucket_and_are_never_shown_again(server, store, caplog):
    _, key_id, secret = store
    _, key = server.new_tenant()
    caplog.set_level(logging.DEBUG)
    r = _put(server, key, {"access_key_id": key_id, "secret_access_key": secret})
    assert r.status_code == 200, r.text
    assert r.json() == {"kind": "s3", "access_key_id": "..." + key_id[-4:], "updated_at": r.json()["updated_at"]}
    with server.http(key) as h:
        listed = h.get("/v1/adapter_source_credentials")
    assert listed.json()["data"] == [r.json()]
    assert _load(server, key, "mine").status_code == 200
    out = server.client(key).completions.create(model="mine", prompt="Once upon a time", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    metrics = server.admin("GET", "/metrics").text
    # Ours at any level; libraries at INFO and up (botocore's DEBUG prints signed headers, by design).
    logged = "\n".join(rec.getMessage() for rec in caplog.records
                       if rec.name.split(".")[0] in ("server", "adapters", "tenants") or rec.levelno >= logging.INFO)
    for text in (r.text, listed.text, metrics, logged):
        assert secret not in text and key_id not in text
    raw = redis.Redis.from_url(server.config.redis_url)
    try:
        for k in raw.scan_iter(count=1000):
            dump = raw.dump(k) or b""
            assert secret.encode() not in dump and key_id.encode() not in dump, k
    finally:
        raw.close()


def test_without_own_keys_a_tenant_gets_the_servers_keys_and_never_anothers(server, store):
    _, key_id, secret = store
    _, owner = server.new_tenant()
    assert _put(server, owner, {"access_key_id": key_id, "secret_access_key": secret}).status_code == 200
    _, other = server.new_tenant()
    r = _load(server, other, "theirs")
    # The server's chain (AKIASERVERCHAIN0000) is unknown to this store: refused (a HEAD's 403 has no
    # error code), where the owner's keys would have been let in.
    assert r.status_code == 502 and "answered 403" in r.text, r.text
    wrong = _put(server, other, {"access_key_id": key_id, "secret_access_key": "x" + secret[1:]})
    assert wrong.status_code == 200
    r = _load(server, other, "theirs")
    assert r.status_code == 502 and "answered 403" in r.text and secret not in r.text, r.text


def test_a_sealed_value_copied_to_another_tenant_does_not_decrypt(server, store):
    _, key_id, secret = store
    owner_name, owner = server.new_tenant()
    thief_name, thief = server.new_tenant()
    assert _put(server, owner, {"access_key_id": key_id, "secret_access_key": secret}).status_code == 200
    ids = {n: server.state.tenants.get(n).id for n in (owner_name, thief_name)}
    ks = server.state.tenants._ks
    raw = redis.Redis.from_url(server.config.redis_url)
    try:
        fields = raw.hgetall(ks.source_credentials(ids[owner_name]))
        raw.hset(ks.source_credentials(ids[thief_name]), mapping=fields)
    finally:
        raw.close()
    r = _load(server, thief, "stolen")
    assert r.status_code == 502 and "answered 403" in r.text, r.text
    assert _load(server, owner, "own").status_code == 200


def test_delete_forgets_them_and_a_deleted_tenant_leaves_none(server, store):
    _, key_id, secret = store
    name, key = server.new_tenant()
    assert _put(server, key, {"access_key_id": key_id, "secret_access_key": secret}).status_code == 200
    with server.http(key) as h:
        assert h.delete("/v1/adapter_source_credentials/s3").json() == {"kind": "s3", "deleted": True}
        assert h.delete("/v1/adapter_source_credentials/s3").status_code == 404
        assert h.get("/v1/adapter_source_credentials").json()["data"] == []
    assert _put(server, key, {"access_key_id": key_id, "secret_access_key": secret}).status_code == 200
    tenant_id = server.state.tenants.get(name).id
    assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    raw = redis.Redis.from_url(server.config.redis_url)
    try:
        assert not raw.exists(server.state.tenants._ks.source_credentials(tenant_id))
    finally:
        raw.close()


@pytest.mark.parametrize("body, param", [
    ({"access_key_id": "AKIA0000", "secret_access_key": "s", "region": "x"}, "region"),
    ({"access_key_id": "AK IA", "secret_access_key": "s"}, "access_key_id"),
    ({"access_key_id": "AKIA0000", "secret_access_key": "has space"}, "secret_access_key"),
    ({"access_key_id": "AKIA0000", "secret_access_key": "s" * 257}, "secret_access_key"),
    ({"access_key_id": "AKIA0000"}, "secret_access_key"),
])
def test_bad_credentials_get_a_400_naming_the_field(server, body, param):
    _, key = server.new_tenant()
    r = _put(server, key, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with server.http(key) as h:
        assert h.put("/v1/adapter_source_credentials/gcs", json=body).status_code == 404


def test_a_server_that_allows_no_s3_keeps_no_s3_secrets(api_server):
    _, key = api_server.new_tenant()
    r = _put(api_server, key, {"access_key_id": "AKIA0000", "secret_access_key": "s"})
    assert r.status_code == 403 and "--adapter-sources" in r.text


def test_the_key_file_is_made_once_owner_only_and_a_bad_one_is_refused(tmp_path):
    from server.credentials import load_or_create_key

    path = tmp_path / "source-credentials.key"
    key = load_or_create_key(path, 32)
    assert len(key) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_key(path, 32) == key
    path.write_text("c2hvcnQ=\n")  # base64 of 5 bytes
    with pytest.raises(ValueError, match="32 bytes"):
        load_or_create_key(path, 32)
