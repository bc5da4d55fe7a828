"""Adapters know their base (issue 42, item 5): a data dir and Redis reused under another `--model` keep
the old base's adapters stored and listed as unavailable with the reason, hidden from /v1/models, and a
request for one is a 400 naming the adapter and both bases (never a retryable 503); an upload declaring
another base model is warned about, or refused under --strict-adapter-base. Real servers, restarted on
the same Redis and data dir with another tiny model."""
from __future__ import annotations

import dataclasses
import json
import shutil

import openai
import pytest

from adapters.chunks import RegistryKeys
from server.api.base_identity import base_identity
from server.demo import make_adapter, make_base_model
from server.engine.config import ModelConfig
from tests.fixtures_server import api_redis_url, running_server, server_config

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Another tiny Llama, twice as wide as the first: the first's adapters cannot fit it."""
    return make_base_model(tmp_path_factory.mktemp("other-model"), "llama", hidden_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=256)


def _declaring(tmp_path, adapter_dir, base_name: str):
    out = tmp_path / f"declares-{base_name.replace('/', '_')}"
    shutil.copytree(adapter_dir, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base_name}))
    return out


def test_a_model_change_leaves_the_old_bases_adapters_listed_unavailable(
        tmp_path, redis_server, tiny_model_dir, other_model_dir, tiny_adapters, core_starter):
    url, data = api_redis_url(redis_server), tmp_path / "data"
    first_config = server_config(tiny_model_dir, data, url)
    with running_server(first_config, starter=core_starter) as first:
        tenant, key = first.new_tenant()
        up = first.upload(key, "sql", tiny_adapters["r4_qv"])
        assert up.status_code == 201 and up.json()["base"] == first.state.base, up.text
        assert "warnings" not in up.json()
        first_base = first.state.base
    second_config = server_config(other_model_dir, data, api_redis_url(redis_server, flush=False),
                                  strict_adapter_base=True)
    with running_server(second_config, starter=core_starter) as second:
        served = second.state.base
        assert served != first_base and served.startswith(f"{second.state.model_id}@")
        with second.http(key) as h:
            listed = h.get("/v1/adapters/sql").json()
            assert listed["available"] is False and listed["base"] == first_base
            reason = listed["unavailable_reason"]
            assert f"adapter 'sql' was validated against base model '{first_config.model_id}'" in reason
            assert f"this server serves '{second.state.model_id}'" in reason
            assert [a["available"] for a in h.get("/v1/adapters").json()["data"]] == [False]
            assert "sql" not in [m["id"] for m in h.get("/v1/models").json()["data"]]
            r = h.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "adapter_base_mismatch" and error["param"] == "model"
            assert error["message"] == reason
        with pytest.raises(openai.BadRequestError):  # not retried: a 400, where a 503 was retried
            second.client(key).chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}])
        # Uploaded again for this base: available and answering.
        fresh = make_adapter(other_model_dir, tmp_path / "sql-for-other", r=4, lora_alpha=8,
                             target_modules=("q_proj", "v_proj"), seed=5)
        assert second.upload(key, "sql", fresh, replace=True).status_code == 201
        with second.http(key) as h:
            assert h.get("/v1/adapters/sql").json()["available"] is True
            r = h.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200, r.text
            # --strict-adapter-base: an upload naming another base model is refused, naming it.
            refused = second.upload(key, "other", _declaring(tmp_path, fresh, "meta-llama/Llama-3.1-8B"))
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "base_model_name_or_path"
            assert "'meta-llama/Llama-3.1-8B'" in refused.json()["error"]["message"]
            assert h.get("/v1/adapters/other").status_code == 404


def test_versions_stored_before_bases_were_recorded(tmp_path, redis_server, tiny_model_dir, other_model_dir,
                                                   tiny_adapters, core_starter):
    """An older loraplex stored no base: a version is validated against the served base on its first use
    and the base recorded; one that does not fit is a 400 naming it, not a 503."""
    url, data = api_redis_url(redis_server), tmp_path / "data"
    with running_server(server_config(tiny_model_dir, data, url), starter=core_starter) as first:
        tenant, key = first.new_tenant()
        tenant_id = first.admin("GET", f"/admin/tenants/{tenant}").json()["id"]
        for name in ("kept", "moved"):
            assert first.upload(key, name, tiny_adapters["r4_qv"]).status_code == 201
            # What an older loraplex stored: the same record without its base.
            version = first.state.registry.get(tenant_id, name).version
            assert first.state.redis.hdel(RegistryKeys(first.config.redis_prefix).version(version), "base") == 1
        with first.http(key) as h:
            assert h.get("/v1/adapters/kept").json()["base"] is None
            r = h.post("/v1/completions", json={"model": "kept", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert h.get("/v1/adapters/kept").json()["base"] == first.state.base
    with running_server(server_config(other_model_dir, data, api_redis_url(redis_server, flush=False)),
                        starter=core_starter) as second:
        with second.http(key) as h:
            assert h.get("/v1/adapters/kept").json()["available"] is False
            r = h.post("/v1/completions", json={"model": "moved", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert message.startswith("adapter 'moved' was stored before loraplex recorded adapters' base models "
                                      f"and does not fit the served base model '{second.state.model_id}'"), message
            assert r.json()["error"]["code"] == "adapter_base_mismatch"


def test_a_declared_base_of_another_name_is_warned_about(api_server, tmp_path, tiny_adapters):
    _, key = api_server.new_tenant()
    model_id = api_server.state.model_id
    same = api_server.upload(key, "same", _declaring(tmp_path, tiny_adapters["r4_qv"], f"some-org/{model_id}"))
    assert same.status_code == 201 and "warnings" not in same.json(), same.text
    other = api_server.upload(key, "other", _declaring(tmp_path, tiny_adapters["r4_qv"], "org/Another-Model"))
    assert other.status_code == 201, other.text
    assert other.json()["warnings"] == [
        f"adapter_config.json declares base_model_name_or_path 'org/Another-Model', and this server serves "
        f"'{model_id}': outputs are right only if the adapter was trained on this model's weights"]


def test_the_fingerprint_tells_apart_models_of_the_same_shapes(tiny_model_dir, model_variant_dir):
    llama = ModelConfig.from_dir(str(tiny_model_dir))
    mistral = ModelConfig.from_dir(str(model_variant_dir("mistral")))
    assert (llama.hidden_size, llama.num_layers) == (mistral.hidden_size, mistral.num_layers)
    assert base_identity("m", llama) != base_identity("m", mistral)
    assert base_identity("m", llama) == base_identity("m", ModelConfig.from_dir(str(tiny_model_dir)))
    # A window is attention's reach, not what a delta means: windowed layers keep a base's fingerprint.
    windowed = dataclasses.replace(mistral, sliding_window=64, layer_windows=(64,) * mistral.num_layers)
    assert base_identity("m", windowed) == base_identity("m", mistral)
