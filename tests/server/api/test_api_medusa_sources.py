"""An adapter's own Medusa heads from a source: a local directory's `medusa/` folder is fetched with its PEFT
files (vLLM's /v1/load_lora_adapter and --lora-modules alike), checked as an upload's are (400 naming the
mismatch) and served: its requests draft with its heads, every text the one speculation off gives. The heads'
bytes count in the adapter's size_bytes and against the tenant's max_adapter_bytes.
Real redis, uvicorn and the openai client; in-process, to read the engine's proposer."""
from __future__ import annotations

import json
import shutil
import tarfile

from adapters.sharing import OPERATOR_OWNER
from adapters.medusa_format import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.server.api.test_api_medusa_heads import greedy_texts, upload_with_heads
from tests.server.engine.test_speculative_medusa import prompts_of, random_heads

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
HEADS_BYTES = 4 * (64 * 64 + 64) * 4  # random_heads' 4 heads over hidden size 64, as float32


def _adapter_dir(root, name, adapter_dir, heads=None):
    d = root / name
    d.mkdir(parents=True)
    for f in PEFT_FILES:
        shutil.copy(adapter_dir / f, d / f)
    if heads is not None:
        shutil.copytree(heads, d / ADAPTER_DIR)
    return d


def test_a_local_sources_medusa_folder_is_fetched_checked_and_drafts_for_its_requests(
        tmp_path, tiny_model_dir, tiny_adapters, redis_server, core_starter):
    root = tmp_path / "root"
    own = random_heads(tmp_path / "own", seed=1)
    _adapter_dir(root, "with-heads", tiny_adapters["r8_all"], own)
    _adapter_dir(root, "operator", tiny_adapters["r4_qv"], random_heads(tmp_path / "op", seed=2))
    half = _adapter_dir(root, "half", tiny_adapters["r8_all"], own)
    (half / ADAPTER_DIR / WEIGHTS_FILE).unlink()
    _adapter_dir(root, "misfit", tiny_adapters["r8_all"], random_heads(tmp_path / "bad", hidden=32))
    spec = {"method": "medusa", "model": str(random_heads(tmp_path / "base-heads")), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server),
                           speculative_config=json.dumps(spec), engine_process="in-process",
                           adapter_sources=("local",), adapter_local_root=str(root),
                           lora_modules=(("operator", str(root / "operator")),),
                           adapters=(("default", "preloaded", str(root / "with-heads")),))
    with running_server(config, starter=core_starter) as server:
        name, key = server.new_tenant()
        registry = server.state.registry
        [operator] = registry.list(OPERATOR_OWNER)
        assert registry.read_medusa(operator.version) == tuple(
            (root / "operator" / ADAPTER_DIR / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE))
        with server.http(key) as h:
            loaded = h.post("/v1/load_lora_adapter", json={"lora_name": "with-heads", "lora_path": "with-heads"})
            assert loaded.status_code == 200, loaded.text
            missing = h.post("/v1/load_lora_adapter", json={"lora_name": "half", "lora_path": "half"})
            assert missing.status_code == 400
            assert f"{ADAPTER_DIR}/ folder has no {WEIGHTS_FILE}" in missing.text
            misfit = h.post("/v1/load_lora_adapter", json={"lora_name": "misfit", "lora_path": "misfit"})
            assert misfit.status_code == 400
            assert "hidden_size 32 does not match the base model's hidden_size 64" in misfit.text
        tenant_id = server.state.tenants.get(name).id
        with_heads = registry.get(tenant_id, "with-heads")
        own_files = tuple((own / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE))
        assert registry.read_medusa(with_heads.version) == own_files
        [preloaded] = registry.list(server.state.tenants.get("default").id)  # --adapter default/preloaded=DIR
        assert registry.read_medusa(preloaded.version) == own_files
        assert preloaded.size_bytes == with_heads.size_bytes
        jobs = list(zip(prompts_of(6, seed=5), [server.state.model_id, "with-heads", "operator"] * 2))
        drafted = greedy_texts(server.client(key), jobs)
        engine = server.state.engine.engine
        assert len(engine.runner.medusa.slot_heads) == 2, "each adapter with heads has them in its slot"
        assert engine.stats().speculative.num_draft_tokens > 0
        plain = greedy_texts(server.client(key), jobs, speculative=False)
    assert drafted == plain


def test_medusa_heads_count_in_size_bytes_and_against_max_adapter_bytes(tmp_path, tiny_model_dir, tiny_adapters,
                                                                         redis_server, core_starter):
    root = tmp_path / "root"
    own = random_heads(tmp_path / "own", seed=1)
    directory = _adapter_dir(root, "with-heads", tiny_adapters["r8_all"], own)
    with tarfile.open(root / "with-heads.tar", "w") as tf:  # an archive's medusa/ folder comes along too
        tf.add(directory, arcname="adapter")
    spec = {"method": "medusa", "model": str(random_heads(tmp_path / "base-heads")), "num_speculative_tokens": 3}
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server),
                           speculative_config=json.dumps(spec), adapter_sources=("local",),
                           adapter_local_root=str(root), adapter_load_workers=0)  # fetched in the server process
    with running_server(config, starter=core_starter) as server:
        name, key = server.new_tenant()
        plain = upload_with_heads(server, key, "plain", tiny_adapters["r8_all"])
        assert plain.status_code == 201, plain.text
        with_heads = upload_with_heads(server, key, "with-heads", tiny_adapters["r8_all"], own)
        assert with_heads.status_code == 201, with_heads.text
        assert with_heads.json()["size_bytes"] == plain.json()["size_bytes"] + HEADS_BYTES
        with server.http(key) as h:
            for lora_name, path in (("fetched", "with-heads"), ("fetched-tar", "with-heads.tar")):
                fetched = h.post("/v1/load_lora_adapter", json={"lora_name": lora_name, "lora_path": path})
                assert fetched.status_code == 200, fetched.text
        tenant_id = server.state.tenants.get(name).id
        for lora_name in ("fetched", "fetched-tar"):
            record = server.state.registry.get(tenant_id, lora_name)
            assert record.size_bytes == with_heads.json()["size_bytes"]
            assert server.state.registry.read_medusa(record.version) == tuple(
                (own / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE))
        # Room for the adapter, not for its heads too.
        _, tight = server.new_tenant({"max_adapter_bytes": plain.json()["size_bytes"] + HEADS_BYTES - 1})
        assert upload_with_heads(server, tight, "plain", tiny_adapters["r8_all"]).status_code == 201
        refused = upload_with_heads(server, tight, "with-heads", tiny_adapters["r8_all"], own)
        assert refused.status_code == 413, refused.text
        assert f"({HEADS_BYTES} of them its medusa heads)" in refused.json()["error"]["message"]
        with server.http(tight) as h:
            fetched = h.post("/v1/load_lora_adapter", json={"lora_name": "with-heads", "lora_path": "with-heads"})
        assert fetched.status_code == 413 and "max_adapter_bytes" in fetched.text
