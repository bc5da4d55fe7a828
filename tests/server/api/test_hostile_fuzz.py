"""A bounded, seeded fuzz of every endpoint: random and boundary JSON (wrong types, huge and tiny
numbers, deep nesting, surrogates, huge strings) never gets a 5xx, every error is OpenAI-shaped,
and a control request answers exactly as before afterwards."""
from __future__ import annotations

import json
import random

import httpx

SEED = 20261122
ROUNDS = 12  # per endpoint; each round sends one mutated body

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "stop_token_ids", "stream", "stream_options", "n", "best_of", "logprobs",
          "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias", "priority",
          "ignore_eos", "suffix", "tools", "name", "quota", "requests_per_minute", "tokens_per_minute",
          "max_concurrent_requests", "max_adapters", "weight", "user"]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(14)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63, -(2**63) - 1, 10**23, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e-320, 5e-324, 1e-40, 1e308, -1e308, 0.5, 2.0000001, rng.random()])
    if kind == 4:
        return rng.choice(["", "a", "\ud800", "x\udfffy", "\u0000", "é" * 50, "<|eos|>", "9" * 5000])
    if kind == 5:
        return "z" * rng.choice([1_000, 100_000])
    if kind == 6:  # deep nesting
        node = 1
        for _ in range(rng.choice([10, 40, 200])):
            node = [node] if rng.random() < 0.5 else {"k": node}
        return node
    if kind == 7 and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 8 and depth < 3:
        return {rng.choice(FIELDS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 9:
        return [rng.randrange(-5, 600) for _ in range(rng.randrange(1, 40))]
    if kind == 10:
        return [{"role": rng.choice(["user", "system", "assistant", "tool", "\ud800"]),
                 "content": _value(rng, depth + 1)}]
    if kind == 11:
        return {"include_usage": _value(rng, 3)}
    return rng.choice(["hello", 3, 0.7, [1, 2, 3]])


def _mutate(rng: random.Random, body: dict) -> dict:
    out = dict(body)
    for _ in range(rng.randrange(1, 4)):
        out[rng.choice(FIELDS)] = _value(rng)
    if rng.random() < 0.1:
        out.pop(rng.choice(list(out) or ["model"]), None)
    return out


def _check(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], (what, r.text[:500])


def test_fuzz_every_endpoint(api_server, tiny_adapters):
    rng = random.Random(SEED)
    model = api_server.state.model_id
    _, key = api_server.new_tenant()
    assert api_server.upload(key, "fz", tiny_adapters["r4_qv"]).status_code == 201
    control = {"model": "fz", "prompt": [3, 14, 15, 92, 65], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    admin = api_server.config.admin_token
    with api_server.http(key) as h:
        before = h.post("/v1/completions", json=control).json()["choices"][0]["text"]

    completion = {"model": model, "prompt": "hi", "max_tokens": 3}
    chat = {"model": "fz", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    tenant_body = {"name": "fz-t", "quota": {"requests_per_minute": 10}}
    patched, _ = api_server.new_tenant()  # not the control's tenant: a fuzzed quota could throttle it
    targets = [("POST", "/v1/completions", key, completion), ("POST", "/v1/chat/completions", key, chat),
               ("POST", "/admin/tenants", admin, tenant_body),
               ("PATCH", f"/admin/tenants/{patched}", admin, {"quota": {"weight": 2}})]
    with httpx.Client(base_url=api_server.url, timeout=60) as h:
        for method, path, token, body in targets:
            for i in range(ROUNDS):
                raw = json.dumps(_mutate(rng, body), ensure_ascii=True).encode()
                if i % 4 == 3:  # and bytes that are not quite JSON
                    cut = rng.randrange(len(raw))
                    raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
                r = h.request(method, path, content=raw, headers={"Authorization": f"Bearer {token}",
                                                                   "content-type": "application/json"})
                _check(r, f"{method} {path} {raw[:200]!r}")
        odd_names = ["", "x" * 300, "..", "a/b", "%00", "%ED%A0%80", "fz%20", "é", "fz"]
        for name in odd_names:
            for method, path, token in [("GET", f"/v1/adapters/{name}", key),
                                        ("GET", f"/admin/tenants/{name}", admin),
                                        ("PATCH", f"/admin/tenants/{name}", admin),
                                        ("POST", f"/admin/tenants/{name}/keys", admin),
                                        ("DELETE", f"/admin/tenants/{name}/keys/{name}", admin),
                                        ("DELETE", f"/v1/adapters/{name}-nope", key)]:
                r = h.request(method, path, headers={"Authorization": f"Bearer {token}"}, json={})
                _check(r, f"{method} {path}")
        for days in ["", "0", "-5", "9" * 400, "%ED%A0%80", "1" * 20, "abc", "3"]:
            _check(h.get(f"/v1/usage?days={days}", headers={"Authorization": f"Bearer {key}"}), days)
        for i in range(ROUNDS):  # multipart uploads with random fields and files
            files = {"adapter_config.json": ("adapter_config.json", json.dumps(_value(rng)).encode()),
                     "adapter_model.safetensors": ("w", rng.randbytes(rng.randrange(0, 2000)))}
            data = {"name": rng.choice(["ok", "", "x" * 100, "\u00e9"]), "replace": rng.choice(["true", "maybe"])}
            r = h.post("/v1/adapters", data=data, files=files, headers={"Authorization": f"Bearer {key}"})
            _check(r, f"upload {i}")
        for path in ["/health", "/v1/models", "/metrics"]:
            _check(h.get(path, headers={"Authorization": f"Bearer {key}"}), path)
        for auth in ["Bearer", "Bearer \ud800".encode("utf-8", "surrogatepass"), b"Basic abc", b"Bearer " + b"\xff" * 10]:
            r = h.get("/v1/models", headers={"Authorization": auth})
            _check(r, f"auth {auth!r}")

    assert api_server.state.engine.is_healthy
    with api_server.http(key) as h:
        after = h.post("/v1/completions", json=control).json()["choices"][0]["text"]
    assert after == before
