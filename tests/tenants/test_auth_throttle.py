"""Failed-auth throttling against a real server and Redis: an address that keeps failing gets 429
with Retry-After before its key is checked; a key id under attack from many addresses answers the
attacker 429 while its owner's right secret keeps working. Client addresses come from
X-Forwarded-For, which uvicorn trusts from 127.0.0.1 as it would from a local proxy."""
from __future__ import annotations

import httpx
import pytest

from tenants import AuthThrottle
from tenants.limits import address_bucket
from tests.fixtures_server import api_redis_url, running_server, server_config

LIMIT = 5


def _models(url: str, key: str, address: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/models", timeout=30,
                     headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": address})


def _wrong_secret(key: str, n: int) -> str:
    """Same key id, another well-formed secret."""
    key_id = key.split(".")[0]
    return f"{key_id}.{str(n).rjust(43, 'A')}"


@pytest.fixture(scope="module")
def server(tiny_model_dir, redis_server, tmp_path_factory, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("auth"), api_redis_url(redis_server),
                           auth_failure_limit=LIMIT)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def test_an_address_that_keeps_failing_is_refused_before_its_key_is_checked(server):
    _, key = server.new_tenant()
    attacker, owner = "203.0.113.7", "198.51.100.2"
    codes = [_models(server.url, _wrong_secret(key, i), attacker).status_code for i in range(LIMIT)]
    assert codes == [401] * LIMIT
    for i in range(20):
        r = _models(server.url, _wrong_secret(key, LIMIT + i), attacker)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "auth_throttled"
        assert 1 <= int(r.headers["retry-after"]) <= 60
    # Not even the right key from that address: it can no longer guess at all...
    assert _models(server.url, key, attacker).status_code == 429
    # ...while the key's owner, elsewhere, is unaffected.
    assert _models(server.url, key, owner).status_code == 200


def test_a_key_under_attack_from_many_addresses_still_admits_its_owner(server):
    _, key = server.new_tenant()
    owner = "198.51.100.9"
    codes = []
    for i in range(60):  # 60 attackers, one guess each: no address reaches its limit
        codes.append(_models(server.url, _wrong_secret(key, i), f"192.0.2.{i + 1}").status_code)
        if i % 10 == 0:
            assert _models(server.url, key, owner).status_code == 200
    assert codes[:LIMIT] == [401] * LIMIT and set(codes[LIMIT:]) == {429}, codes
    r = _models(server.url, _wrong_secret(key, 99), "192.0.2.200")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert _models(server.url, key, owner).status_code == 200
    # Other tenants' keys, from a fresh address, are untouched.
    _, other = server.new_tenant()
    assert _models(server.url, other, "192.0.2.250").status_code == 200
    assert _models(server.url, _wrong_secret(other, 1), "192.0.2.251").status_code == 401


def test_unknown_key_ids_and_garbage_count_against_the_address(server):
    address = "203.0.113.50"
    codes = [_models(server.url, token, address).status_code
             for token in ["not-a-key", "lp-0123456789abcdef." + "x" * 43, "Bearer-ish", "lp-", "x" * 200,
                           "lp-fedcba9876543210." + "y" * 43]]
    assert codes == [401] * LIMIT + [429]
    metrics = server.admin("GET", "/metrics").text
    assert 'loraplex_auth_failures_total{outcome="throttled"}' in metrics
    assert 'loraplex_auth_failures_total{outcome="invalid"}' in metrics


def test_throttle_counts_in_redis_and_windows_expire(redis_client):
    throttle = AuthThrottle(redis_client, limit=2, window_seconds=0.5)
    assert throttle.blocked("10.0.0.1") is None
    assert throttle.failed("10.0.0.1", "aaaaaaaaaaaaaaaa") is None
    assert throttle.failed("10.0.0.2", "aaaaaaaaaaaaaaaa") is None
    assert throttle.failed("10.0.0.3", "aaaaaaaaaaaaaaaa") == 1  # the key id's third failure
    assert throttle.blocked("10.0.0.3") is None                 # one failure from that address
    assert throttle.failed("10.0.0.1", None) is None
    assert throttle.blocked("10.0.0.1") == 1
    redis_client.delete("lp:authfail:addr:10.0.0.1")  # as when its window ends
    assert throttle.blocked("10.0.0.1") is None
    assert address_bucket("2001:db8::1") == address_bucket("2001:db8::ffff") == "2001:db8::/64"
    assert address_bucket("::ffff:10.0.0.1") == "10.0.0.1" and address_bucket(None) == "unknown"


def _admin_get(url: str, path: str, token: str, address: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", timeout=30,
                     headers={"Authorization": f"Bearer {token}", "X-Forwarded-For": address})


@pytest.mark.parametrize("path", ["/admin/tenants", "/metrics"])
def test_an_address_guessing_the_admin_or_metrics_token_is_refused_before_it_is_checked(server, path):
    attacker, operator = f"203.0.113.{100 + len(path)}", f"198.51.100.{100 + len(path)}"
    admin_token = server.config.admin_token
    codes = [_admin_get(server.url, path, f"guess-{i}", attacker).status_code for i in range(LIMIT)]
    assert codes == [401] * LIMIT
    r = _admin_get(server.url, path, "guess-next", attacker)
    assert r.status_code == 429 and r.json()["error"]["code"] == "auth_throttled", r.text
    assert 1 <= int(r.headers["retry-after"]) <= 60
    # Past the limit even the right token proves nothing from there...
    assert _admin_get(server.url, path, admin_token, attacker).status_code == 429
    # ...while the operator elsewhere is unaffected.
    assert _admin_get(server.url, path, admin_token, operator).status_code == 200


def test_admin_requests_without_a_token_or_with_a_tenant_key_are_not_counted_as_guesses(server):
    _, key = server.new_tenant()
    address = "203.0.113.150"
    for _ in range(LIMIT + 3):
        assert httpx.get(f"{server.url}/admin/tenants", timeout=30,
                         headers={"X-Forwarded-For": address}).status_code == 401
        assert _admin_get(server.url, "/admin/tenants", key, address).status_code == 403
    assert _admin_get(server.url, "/admin/tenants", server.config.admin_token, address).status_code == 200
