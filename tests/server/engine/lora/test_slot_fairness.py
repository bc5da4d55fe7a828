"""One tenant's many distinct adapters (more than there are device slots) neither stall another
tenant's requests that need no new slot, nor starve the adapter-blocked head of the queue."""
from __future__ import annotations

from adapters.format import load_adapter_dir
from server.engine import LLMEngine, EngineConfig, SamplingParams
from server.engine.scheduler import MAX_BYPASS_STEPS
from tests.engine_helpers import GREEDY

STORM_ADAPTERS = 40
STEPS = 200


def engine_with_storm_adapters(tiny_model_dir, tiny_adapters, max_loras: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", max_loras=max_loras,
                                       kv_cache_blocks=512, max_model_len=256, max_num_seqs=32))
    packed = load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64)
    for i in range(STORM_ADAPTERS):  # distinct versions: each needs a slot of its own
        engine.add_adapter(f"s{i}@1", packed)
    engine.add_adapter("resident@1", packed)
    return engine


class Storm:
    """The warm storm of benchmarks/serving/bench_cold_sources.py: a tenant keeps 16 one-token requests waiting,
    each for the next of its 40 adapters, so the slots thrash and the queue's head waits for one."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.sent, self.in_flight = engine, 0, set()

    def top_up(self) -> None:
        while len(self.in_flight) < 16:
            rid = f"storm{self.sent}"
            self.engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY),
                                    f"s{self.sent % STORM_ADAPTERS}@1", tenant="storm")
            self.in_flight.add(rid)
            self.sent += 1

    def step(self) -> dict:
        self.top_up()
        outs = {o.request_id: o for o in self.engine.step()}
        self.in_flight -= {rid for rid, o in outs.items() if o.finished}
        return outs


def victim_under_storm(engine: LLMEngine, adapter: str | None, streams: int, weight: float,
                       prompt_len: int) -> tuple[int, int]:
    """The victim tenant keeps `streams` 16-token requests running (started apart, so one is always
    in flight), behind the storm in fair-share order (by its weight, or its longer prompts); (the most steps any of its requests waited for its first token,
    steps in which none of its requests got a token though one was running)."""
    storm, params = Storm(engine), SamplingParams(max_tokens=16, **GREEDY)
    arrived: dict[str, int] = {}
    running: set[str] = set()
    worst_wait, idle, sent = 0, 0, 0
    for step in range(1, STEPS + 1):
        while len(arrived) + len(running) < min(streams, 1 + step // 8):  # streams start 8 steps apart
            rid = f"v{sent}"
            prompt = [9 + sent % 50] + [10] * (prompt_len - 1)
            engine.add_request(rid, prompt, params, adapter, tenant="victim", tenant_weight=weight)
            arrived[rid] = step
            sent += 1
        outs = storm.step()
        got = {rid for rid in arrived.keys() | running if rid in outs and outs[rid].token_ids}
        idle += bool(running) and not (got & running)
        for rid in got & arrived.keys():
            worst_wait = max(worst_wait, step - arrived.pop(rid))
            running.add(rid)
        running -= {rid for rid in got if outs[rid].finished}
        worst_wait = max([worst_wait] + [step - a for a in arrived.values()])
    assert sent >= 2 * streams  # the victim went through several requests of its own
    return worst_wait, idle


def test_base_model_requests_pass_a_tenant_thrashing_the_slots(tiny_model_dir, tiny_adapters):
    engine = engine_with_storm_adapters(tiny_model_dir, tiny_adapters, max_loras=2)
    worst_wait, idle = victim_under_storm(engine, None, streams=1, weight=0.2, prompt_len=3)
    # Scheduled in the step it arrives (it needs no slot), and decoding every step after.
    assert worst_wait <= 1 and idle == 0, (worst_wait, idle)
    assert engine.scheduler.head_blocked_steps > MAX_BYPASS_STEPS  # the storm's head did wait long
    engine.shutdown()


def test_a_tenant_within_its_slot_share_keeps_its_resident_adapter(tiny_model_dir, tiny_adapters):
    engine = engine_with_storm_adapters(tiny_model_dir, tiny_adapters, max_loras=3)
    # Three overlapping streams keep the victim's adapter in use: within its share (1 of 3 slots, the
    # share is 1.5), it keeps the slot however long the storm's head waits for one.
    worst_wait, idle = victim_under_storm(engine, "resident@1", streams=3, weight=1.0, prompt_len=40)
    assert worst_wait <= 1 and idle == 0, (worst_wait, idle)
    assert engine.scheduler.head_blocked_steps > MAX_BYPASS_STEPS
    engine.shutdown()


def test_the_slot_blocked_head_is_served_while_others_keep_the_slot_busy(tiny_model_dir, tiny_adapters):
    """One slot; tenant A keeps two requests on its resident adapter at all times and tenant C streams
    base-model requests: tenant B's request for another adapter still gets the slot within a bound."""
    engine = engine_with_storm_adapters(tiny_model_dir, tiny_adapters, max_loras=1)
    params = SamplingParams(max_tokens=8, **GREEDY)
    live: dict[str, set[str]] = {"A": set(), "C": set()}
    sent = 0
    engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=2, **GREEDY), "s0@1", tenant="B")
    for step in range(1, 4 * MAX_BYPASS_STEPS):
        for tenant, adapter in (("A", "resident@1"), ("C", None)):
            while len(live[tenant]) < 2:
                rid = f"{tenant}{sent}"
                engine.add_request(rid, [9, 10, 11 + sent % 50], params, adapter, tenant=tenant)
                live[tenant].add(rid)
                sent += 1
            if step == 1:
                engine.step()  # A takes the slot before B can
        outs = {o.request_id: o for o in engine.step()}
        for rids in live.values():
            rids -= {rid for rid in rids if rid in outs and outs[rid].finished}
        if "b" in outs and outs["b"].token_ids:
            break
    else:
        raise AssertionError("the request waiting for a slot never got one")
    # It waits the bypass allowance, then for A's running requests to finish (8 tokens), no longer.
    assert step <= MAX_BYPASS_STEPS + 8 + 3, step
    engine.shutdown()
