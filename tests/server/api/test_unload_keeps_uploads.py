"""vLLM's unload semantics (issue 42, item 4): `/v1/unload_lora_adapter` frees an uploaded adapter's
memory (device slot and host tier) and keeps the upload: still listed, still answering, exactly as
before; deleting stays `DELETE /v1/adapters/{name}`."""
from __future__ import annotations

import time

PROMPT = "Once upon a time"


def _greedy(server, key, model) -> str:
    r = server.client(key).completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    return r.choices[0].text


def _memory(server) -> tuple[int, int]:
    """(adapters in the host tier, adapters in device slots), from /admin/engine."""
    engine = server.admin("GET", "/admin/engine").json()
    return engine["host"]["adapters"], engine["slots"]["used"]


def _until(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_unload_frees_memory_and_keeps_the_upload(api_server, tiny_adapters):
    _, key = api_server.new_tenant()
    assert api_server.upload(key, "sql", tiny_adapters["r4_qv"]).status_code == 201
    before = _greedy(api_server, key, "sql")
    host, slots = _memory(api_server)
    assert host >= 1 and slots >= 1
    with api_server.http(key) as h:
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
        assert _until(lambda: _memory(api_server) == (host - 1, slots - 1))
        # Stored and listed as before.
        assert h.get("/v1/adapters/sql").status_code == 200
        assert "sql" in [m["id"] for m in h.get("/v1/models").json()["data"]]
        # Unloading what is not in memory is fine too (the upload is still known).
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    # The next use loads it again, with exactly the same output.
    assert _greedy(api_server, key, "sql") == before
    assert _memory(api_server) == (host, slots)
    with api_server.http(key) as h:
        assert h.delete("/v1/adapters/sql").status_code == 200
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
        assert h.post("/v1/completions", json={"model": "sql", "prompt": "x"}).status_code == 404
