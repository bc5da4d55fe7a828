"""LLMEngine.step_counts(): the steps that ran a batch and those that replayed a decode CUDA graph, the two
counters a bench reads around every step (server.bench.step_kinds). On a CPU no step replays a graph."""
from __future__ import annotations

import pytest

from server.engine import LLM, SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_forward_is_counted_and_none_is_graphed_on_a_cpu(tiny_model_dir, async_scheduling):
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=64, async_scheduling=async_scheduling)
    engine = llm.engine
    assert engine.step_counts().steps == 0
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    counts = engine.step_counts()
    # One prompt step and a decode step per further token, those launched on the async worker included.
    assert counts.steps == 4
    assert (engine.stats().async_scheduling.launched > 0) is async_scheduling
    assert counts.graphed == 0 == engine.stats().decode_graphs.replays
    assert engine.step() == [] and engine.step_counts() == counts  # nothing to run: no step
    engine.shutdown()
