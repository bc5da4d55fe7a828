"""A storm of new adapters under the latency-aware prefill cap, whose slot loads count against the cap
while others decode (server.engine.scheduler, server.engine.step_latency.load_units): every storm request
completes, the decoding tenant gets a token in every step of the storm, and each storm request's tokens
are those of its adapter run alone. The real engine, the tiny model, 2 slots for 12 distinct adapters."""
from __future__ import annotations

import pytest

from adapters.format import load_adapter_dir
from server.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.engine_helpers import GREEDY

pytestmark = pytest.mark.unit

VERSIONS_PER_ADAPTER = 3
STORM_TOKENS = 3


def test_a_storm_of_new_adapters_completes_exactly_while_another_tenant_decodes(tiny_model_dir, tiny_adapters):
    engine = LLMEngine(EngineConfig.of(str(tiny_model_dir), device="cpu", max_loras=2, max_lora_rank=32,
                                    max_prefill_tokens_while_decoding=256, max_prefill_step_ratio=1.25))
    storm = []  # (request id, adapter name, version, prompt)
    for name, path in tiny_adapters.items():
        packed = load_adapter_dir(path, engine.adapter_shape, 32)
        for v in range(VERSIONS_PER_ADAPTER):  # distinct versions: each needs a slot of its own
            version = f"{name}-{v}@1"
            engine.add_adapter(version, packed)
            storm.append((f"s{len(storm)}", name, version, [5 + len(storm), 6, 7, 8, 9, 10, 11]))
    victim = SamplingParams(max_tokens=400, **GREEDY)
    engine.add_request("victim", [7, 8, 9], victim, tenant="victim")
    for _ in range(40):  # the decode-only estimate
        engine.step()
    params = SamplingParams(max_tokens=STORM_TOKENS, **GREEDY)
    for rid, _, version, prompt in storm:
        engine.add_request(rid, prompt, params, version, tenant="storm")
    done: dict[str, list[int]] = {}
    steps = 0
    while len(done) < len(storm):
        steps += 1
        assert steps < 500, "the storm stopped making progress"
        outs = {o.request_id: o for o in engine.step()}
        assert "victim" in outs and not outs["victim"].finished  # a token in every step of the storm
        done.update({rid: o.token_ids for rid, o in outs.items() if rid != "victim" and o.finished})
    assert engine.scheduler.latency.load_seconds is not None  # the loads were timed, and charged from then on
    engine.shutdown()

    alone = LLM(tiny_model_dir, device="cpu", max_loras=len(tiny_adapters), max_lora_rank=32)
    for name, path in tiny_adapters.items():
        alone.add_adapter(name, path)
    for rid, name, _, prompt in storm:
        assert done[rid] == alone.generate([prompt], params, adapters=[name])[0].token_ids, rid
