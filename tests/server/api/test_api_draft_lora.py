"""An adapter uploaded with a draft LoRA of its own (POST /v1/adapters, the optional files
draft_adapter_config.json and draft_adapter_model.safetensors): stored with it in the registry, counted in
its size_bytes, and served: with the draft model the target itself and the draft LoRA the adapter itself,
every greedy draft for its requests is accepted in batches mixed with base and another adapter's
requests, whose texts are those the same requests get without speculation. A draft LoRA that does not fit
the draft model, half of one, or one sent to a server without a draft model is a 400 naming why.
Real redis, uvicorn and the openai client; in-process, to read the engine's proposer."""
from __future__ import annotations

import json

from adapters.draft_lora import FORM_FILES
from adapters.sharing import OPERATOR_OWNER
from server.demo import make_adapter, make_base_model
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.source_servers import FileServer
from tests.server.api.test_api_medusa_heads import greedy_texts
from tests.server.engine.test_speculative_draft_lora import record_drafts, rejected, with_draft_dir
from tests.server.engine.test_speculative_medusa import prompts_of

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def self_draft_config(tmp_path, tiny_model_dir, redis_server, **overrides):
    """A server whose draft model is the target itself (every step speculates)."""
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    return server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server),
                         speculative_config=json.dumps(spec), **overrides)


def upload_with_draft(server, key, name: str, adapter_dir, draft_dir=None, draft_files=FORM_FILES):
    files = {f: (f, (adapter_dir / f).read_bytes()) for f in PEFT_FILES}
    if draft_dir is not None:
        files |= {form: (form, (draft_dir / f).read_bytes()) for form, f in zip(FORM_FILES, PEFT_FILES)
                  if form in draft_files}
    with server.http(key) as h:
        return h.post("/v1/adapters", data={"name": name}, files=files)


def draft_bytes(server) -> int:
    """/admin/engine's bytes of the draft model's LoRA slots."""
    return server.admin("GET", "/admin/engine").json()["slots"]["draft_bytes"]


def test_an_uploaded_draft_lora_drafts_for_its_requests_and_texts_stay_the_plain_engines(
        tmp_path, tiny_model_dir, tiny_adapters, redis_server, core_starter):
    config = self_draft_config(tmp_path, tiny_model_dir, redis_server, engine_process="in-process")
    r8 = tiny_adapters["r8_all"]
    with running_server(config, starter=core_starter) as server:
        _, key = server.new_tenant()
        stored = upload_with_draft(server, key, "self-drafted", r8, r8)
        assert stored.status_code == 201, stored.text
        alone = upload_with_draft(server, key, "alone", r8)
        assert stored.json()["size_bytes"] == 2 * alone.json()["size_bytes"], "the draft LoRA's bytes count"
        assert upload_with_draft(server, key, "plain", tiny_adapters["r4_qv"]).status_code == 201
        size = alone.json()["size_bytes"]
        _, tight = server.new_tenant({"max_adapter_bytes": 2 * size - 1})  # room for the adapter, not its draft
        assert upload_with_draft(server, tight, "alone", r8).status_code == 201
        over = upload_with_draft(server, tight, "self-drafted", r8, r8)
        assert over.status_code == 413 and f"({size} of them its draft LoRA)" in over.json()["error"]["message"]
        half = upload_with_draft(server, key, "half", r8, r8, draft_files=FORM_FILES[:1])
        assert half.status_code == 400 and FORM_FILES[1] in half.json()["error"]["message"]
        small = make_base_model(tmp_path / "small", "llama", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=7)
        misfit = upload_with_draft(server, key, "misfit", r8, make_adapter(small, tmp_path / "small-lora"))
        assert misfit.status_code == 400, misfit.text
        assert "draft LoRA" in misfit.json()["error"]["message"]
        version = stored.json()["version"]
        assert server.state.registry.read_draft(version) == tuple((r8 / f).read_bytes() for f in PEFT_FILES)
        engine = server.state.engine.engine
        seen = record_drafts(engine)
        jobs = list(zip(prompts_of(6, seed=4), [server.state.model_id, "self-drafted", "plain"] * 2))
        no_draft = [job for job in jobs if job[1] != "self-drafted"]
        assert greedy_texts(server.client(key), no_draft) == greedy_texts(server.client(key), no_draft,
                                                                          speculative=False)
        assert draft_bytes(server) == 0, "no adapter with a draft LoRA ran: the draft slots hold no memory"
        drafted = greedy_texts(server.client(key), jobs)
        assert draft_bytes(server) > 0, "allocated when the first draft LoRA entered a slot"
        assert engine.lora_slots.draft.has[engine.lora_slots.slot_of[version]], "its draft LoRA sits in its slot"
        assert sum(1 for s, _, _ in seen if s.version_id == version) > 0
        assert rejected(seen, version) == 0, "a draft of the adapter's own draft LoRA was rejected"
        assert engine.stats().speculative.num_draft_tokens > 0
        plain = greedy_texts(server.client(key), jobs, speculative=False)
    assert drafted == plain


def test_a_draft_lora_is_refused_by_a_server_without_a_draft_model(tmp_path, tiny_model_dir, tiny_adapters,
                                                                  redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server))
    r8 = tiny_adapters["r8_all"]
    with running_server(config, starter=core_starter) as server:
        _, key = server.new_tenant()
        refused = upload_with_draft(server, key, "self-drafted", r8, r8)
        assert refused.status_code == 400 and "runs no draft model" in refused.json()["error"]["message"]


def test_a_draft_folder_comes_from_local_http_and_operator_sources(tmp_path, tiny_model_dir, tiny_adapters,
                                                                   redis_server, core_starter):
    """A local directory's and an http directory's `draft/` folder (/v1/load_lora_adapter, through the loader
    process), --lora-modules and --adapter alike: stored with the version and served."""
    r8 = tiny_adapters["r8_all"]
    root = tmp_path / "root"
    with_draft_dir(r8, r8, root / "self-drafted")
    half = with_draft_dir(r8, r8, root / "half")
    (half / "draft" / PEFT_FILES[1]).unlink()
    with FileServer() as files:
        for f in PEFT_FILES:
            files.files[f"/dir/{f}"] = (r8 / f).read_bytes()
            files.files[f"/dir/draft/{f}"] = (r8 / f).read_bytes()
        config = self_draft_config(tmp_path, tiny_model_dir, redis_server, engine_process="in-process",
                                   adapter_sources=("local", "http"), adapter_local_root=str(root),
                                   adapter_http_hosts=("127.0.0.1",), adapter_allow_private_networks=True,
                                   lora_modules=(("operator", str(root / "self-drafted")),),
                                   adapters=(("default", "preloaded", str(root / "self-drafted")),))
        with running_server(config, starter=core_starter) as server:
            name, key = server.new_tenant()
            with server.http(key) as h:
                for lora_name, path in (("local", "self-drafted"), ("remote", files.url + "/dir/")):
                    loaded = h.post("/v1/load_lora_adapter", json={"lora_name": lora_name, "lora_path": path})
                    assert loaded.status_code == 200, loaded.text
                missing = h.post("/v1/load_lora_adapter", json={"lora_name": "half", "lora_path": "half"})
                assert missing.status_code == 400 and f"draft/ folder has no {PEFT_FILES[1]}" in missing.text
            registry = server.state.registry
            draft = tuple((r8 / f).read_bytes() for f in PEFT_FILES)
            records = [registry.get(server.state.tenants.get(name).id, n) for n in ("local", "remote")]
            records += [registry.get(OPERATOR_OWNER, "operator")]
            records += registry.list(server.state.tenants.get("default").id)  # --adapter default/preloaded=DIR
            assert len(records) == 4 and all(registry.read_draft(r.version) == draft for r in records)
            engine = server.state.engine.engine
            seen = record_drafts(engine)
            jobs = list(zip(prompts_of(6, seed=6), [server.state.model_id, "remote", "operator"] * 2))
            drafted = greedy_texts(server.client(key), jobs)
            for r in records[:3]:
                if r.version in engine.lora_slots.slot_of:
                    assert engine.lora_slots.draft.has[engine.lora_slots.slot_of[r.version]]
            assert rejected(seen, records[1].version) == 0 and rejected(seen, records[2].version) == 0
            plain = greedy_texts(server.client(key), jobs, speculative=False)
    assert drafted == plain


def test_a_draft_lora_is_served_by_an_engine_core_in_its_own_process(tmp_path, tiny_model_dir, tiny_adapters,
                                                                     redis_server, core_starter):
    """The core pages the version in itself (its registry fetch checks the draft LoRA against the draft model
    read from the same --speculative-config): texts stay the plain engine's."""
    config = self_draft_config(tmp_path, tiny_model_dir, redis_server, engine_process="separate")
    r8 = tiny_adapters["r8_all"]
    with running_server(config, starter=core_starter) as server:
        _, key = server.new_tenant()
        assert upload_with_draft(server, key, "self-drafted", r8, r8).status_code == 201
        jobs = list(zip(prompts_of(4, seed=7), [server.state.model_id, "self-drafted"] * 2))
        drafted = greedy_texts(server.client(key), jobs)
        assert server.state.engine.stats().speculative.num_accepted_tokens > 0
        plain = greedy_texts(server.client(key), jobs, speculative=False)
    assert drafted == plain
