"""A stop string that ends one of a request's two choices early (n=2): the front end matches it and aborts
that choice alone back to the engine (server.engine.choice_abort), which stops generating it while the other
choice runs on; the texts are those the choices have without the stop string, cut where it starts; the
tenant's usage counts the tokens the client was given (OpenAI's completion_tokens) and its fair share is
charged for those alone. Real redis and a real server, the engine in-process and in its own process."""
from __future__ import annotations

import time

import pytest

from server.engine.scheduler import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.server.engine.test_engine_sampling import choose_stop

# Both choices' (ignore_eos): without the abort the engine runs 2 x this many. Long, so that the abort's lag
# behind the engine (the front end is another process, and may wait for a core on a loaded machine: 128 tokens
# were not enough under a load average of 23) stays far inside the margin the test allows; within the tiny
# model's 512-token context.
MAX_TOKENS = 480
PROMPT = "The tiny model says"


def generated_when_idle(server, at_least: int) -> int:
    """The engine's output tokens since start, once it is idle and has made `at_least` (its stats are a
    snapshot pushed every 0.25 s by a separate core)."""
    deadline = time.monotonic() + 30
    while True:
        scheduler = server.state.engine.stats().scheduler
        if scheduler.generated_tokens >= at_least and scheduler.running == 0:
            return scheduler.generated_tokens
        assert time.monotonic() < deadline, scheduler
        time.sleep(0.05)


def completion(client, model: str, **kw):
    out = client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=MAX_TOKENS, temperature=1.0,
                                    seed=5, logprobs=0, extra_body={"ignore_eos": True}, **kw)
    return out, sorted(out.choices, key=lambda c: c.index)


@pytest.mark.parametrize("mode", ["in-process", "separate"])
def test_a_choice_a_stop_string_ends_stops_in_the_engine_and_only_its_given_tokens_count(
        mode, tmp_path, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server), engine_process=mode)
    with running_server(config, starter=core_starter) as server:
        name, key = server.new_tenant()
        client, model = server.client(key), server.state.model_id
        _, (a, b) = completion(client, model)
        assert len(a.logprobs.tokens) == len(b.logprobs.tokens) == MAX_TOKENS
        stop = choose_stop(a.text, b.text)
        before = generated_when_idle(server, 2 * MAX_TOKENS)
        counters = server.state.engine.engine.scheduler.waiting.counters if mode == "in-process" else None
        charged = dict(counters) if counters is not None else None
        stopped, (a2, b2) = completion(client, model, stop=[stop])
        # The outputs are the free ones: choice 0 cut where the stop string starts, choice 1 whole.
        assert (a2.text, a2.finish_reason) == (a.text[:a.text.index(stop)], "stop")
        assert (b2.text, b2.finish_reason) == (b.text, "length")
        kept = len(a2.logprobs.tokens)
        assert kept < MAX_TOKENS // 2 and a2.logprobs.tokens == a.logprobs.tokens[:kept]
        # The engine stopped choice 0 soon after its stop (the abort trails the outputs by a few steps),
        # where before it ran to max_tokens with its sibling.
        generated = generated_when_idle(server, before + MAX_TOKENS + kept) - before
        assert generated < 2 * MAX_TOKENS - MAX_TOKENS // 4, (generated, kept)
        # Usage: the tokens the client was given, both requests.
        assert stopped.usage.completion_tokens == kept + MAX_TOKENS
        usage = server.admin("GET", f"/admin/tenants/{name}/usage", params={"days": 1}).json()["total"]
        assert usage["requests"] == 2 and usage["completion_tokens"] == 2 * MAX_TOKENS + kept + MAX_TOKENS
        if counters is not None:  # the fair share: the uncached prompt once, then the given tokens
            (tenant,) = [t for t in counters if t is not None]
            uncached = stopped.usage.prompt_tokens - stopped.usage.prompt_tokens_details.cached_tokens
            expected = uncached * PROMPT_TOKEN_COST + (kept + MAX_TOKENS) * OUTPUT_TOKEN_COST
            weight = server.state.engine.engine.scheduler.waiting.weights.get(tenant, 1.0)
            assert counters[tenant] - charged[tenant] == pytest.approx(expected / weight)
