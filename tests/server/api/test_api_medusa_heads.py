"""An adapter uploaded with Medusa heads of its own (POST /v1/adapters, the optional files medusa_config.json
and medusa_heads.safetensors): stored with it in the registry, its requests draft with its heads while
base and other adapters' requests in the same batches draft with the server's; every text is the one the
same request gets without speculation. Heads that do not fit the base are a 400 naming the mismatch.
Real redis, uvicorn and the openai client; in-process, to read the engine's proposer."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from adapters.medusa_format import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.server.engine.test_speculative_medusa import prompts_of, random_heads


def upload_with_heads(server, key, name: str, adapter_dir, heads_dir=None):
    files = {f: (f, (adapter_dir / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
    if heads_dir is not None:
        files |= {f: (f, (heads_dir / f).read_bytes()) for f in (CONFIG_FILE, WEIGHTS_FILE)}
    with server.http(key) as h:
        return h.post("/v1/adapters", data={"name": name}, files=files)


def greedy_texts(client, jobs: list[tuple[list[int], str]], speculative: bool = True) -> list[str]:
    """Each (prompt, model)'s greedy text: concurrent (mixed batches) when drafting, one at a time with
    speculation off (the plain engine's text)."""
    def complete(job) -> str:
        prompt, model = job
        extra = {"ignore_eos": True} | ({} if speculative else {"speculative": False})
        return client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body=extra).choices[0].text

    if not speculative:
        return [complete(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(complete, jobs))


def test_an_uploaded_adapters_heads_draft_for_its_requests_and_texts_stay_the_plain_engines(
        tmp_path, tiny_model_dir, tiny_adapters, redis_server):
    spec = {"method": "medusa", "model": str(random_heads(tmp_path / "base-heads")), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server),
                           speculative_config=json.dumps(spec), engine_process="in-process")
    own = random_heads(tmp_path / "own" / ADAPTER_DIR, seed=1)
    with running_server(config) as server:
        _, key = server.new_tenant()
        stored = upload_with_heads(server, key, "with-heads", tiny_adapters["r8_all"], own)
        assert stored.status_code == 201
        assert upload_with_heads(server, key, "plain", tiny_adapters["r4_qv"]).status_code == 201
        bad = random_heads(tmp_path / "bad", hidden=32)
        refused = upload_with_heads(server, key, "misfit", tiny_adapters["r8_all"], bad)
        assert refused.status_code == 400
        assert "hidden_size 32 does not match the base model's hidden_size 64" in refused.json()["error"]["message"]
        few = upload_with_heads(server, key, "few", tiny_adapters["r8_all"], random_heads(tmp_path / "few", num_heads=2))
        assert few.status_code == 400 and "fewer than num_speculative_tokens 3" in few.json()["error"]["message"]
        jobs = list(zip(prompts_of(6, seed=4), [server.state.model_id, "with-heads", "plain"] * 2))
        drafted = greedy_texts(server.client(key), jobs)
        engine = server.state.engine.engine
        proposer = engine.runner.medusa
        assert len(proposer.slot_heads) == 1, "the adapter with heads has them in its slot, the other none"
        [slot] = proposer.slot_heads
        assert engine.lora_slots.slot_of[stored.json()["version"]] == slot
        assert server.state.registry.read_medusa(stored.json()["version"]) == tuple(
            (own / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE))
        stats = engine.stats().speculative
        assert stats.num_draft_tokens > 0
        plain = greedy_texts(server.client(key), jobs, speculative=False)
    assert drafted == plain
