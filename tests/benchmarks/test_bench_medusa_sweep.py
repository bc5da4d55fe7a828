"""bench_medusa --k-sweep's engines draft exactly k every decode step (no adaptive k, no rests), and stay the
plain engine's tokens; the adaptive engine beside them drafts fewer once its random heads keep missing."""
from __future__ import annotations

import pytest

from benchmarks.engine.bench_medusa import fixed_k
from server.engine import LLM, SamplingParams
from tests.server.engine.test_speculative_medusa import prompts_of, random_heads, spec

pytestmark = pytest.mark.unit

MAX_TOKENS = 24


def _run(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int]:
    """The request's tokens, and the drafts the engine proposed and the decode steps it ran for it."""
    engine = llm.engine
    drafted, steps = engine.output_processor.num_draft_tokens, 0
    engine.add_request("r", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), None)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            tokens = list(out.token_ids)
    return tokens, engine.output_processor.num_draft_tokens - drafted, steps - 1  # less the prefill


@pytest.mark.parametrize("k", [1, 3])
def test_a_fixed_k_engine_drafts_k_every_step_and_keeps_the_plain_tokens(tiny_model_dir, tmp_path, k):
    heads = random_heads(tmp_path / "heads")
    opts = dict(device="cpu", dtype="float32", max_model_len=256, kernels="torch")
    plain = LLM(tiny_model_dir, **opts)
    fixed = fixed_k(LLM(tiny_model_dir, speculative_config=spec(heads, k), **opts))
    adaptive = LLM(tiny_model_dir, speculative_config=spec(heads, k), **opts)
    prompt = prompts_of(1, seed=3)[0]
    want, _, _ = _run(plain, prompt)
    got, drafted, steps = _run(fixed, prompt)
    assert got == want
    # Every decode step drafts k, fewer only in the last k, where max_tokens leaves less room.
    assert k * (steps - k) <= drafted <= k * steps, (drafted, steps)
    got, adaptive_drafted, _ = _run(adaptive, prompt)
    assert got == want and adaptive_drafted < drafted
