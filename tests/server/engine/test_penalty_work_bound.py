"""Per-request penalty work per step is bounded (issue 43, build item 1): a request with a long
history (a long prompt with a repetition penalty, a long output with presence and frequency
penalties, logit_bias) adds to a shared step only its distinct tokens, never its whole history
again, so its neighbours' steps do not grow with it. Measured in operations (tokens counted,
(row, token) pairs built), not wall-clock; and the result is still the definition's."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from server.engine.model_runner import _add_rows
from server.engine.sampler import LogitsProcessors
from server.engine.sequence import SamplingParams, Sequence
from tests.server.engine.test_engine_openai_sampling import reference_penalties

pytestmark = pytest.mark.unit

VOCAB = 64
PROMPT_LEN = 20_000
DISTINCT_PROMPT = 7
DISTINCT_OUTPUT = 5


def _sequence(request_id: str, params: SamplingParams, prompt: list[int]) -> Sequence:
    return Sequence(request_id, prompt, params, None, arrival=0)


def _step_rows(seqs: list[Sequence]) -> list:
    """The rows a step samples these sequences with, built as the model runner builds them."""
    rows: list = []
    for seq in seqs:
        _add_rows(rows, seq)
    return rows


def test_a_long_history_costs_a_step_its_distinct_tokens_not_its_length():
    heavy = _sequence("heavy", SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                              logit_bias={3: 2.0}, max_tokens=100_000),
                      [i % DISTINCT_PROMPT for i in range(PROMPT_LEN)])
    neighbour = _sequence("neighbour", SamplingParams(), [1, 2, 3])
    steps, pairs_per_step = 3000, []
    for step in range(steps):
        token = 10 + step % DISTINCT_OUTPUT
        heavy.token_ids.append(token)
        neighbour.token_ids.append(token)
        processors = LogitsProcessors.build(_step_rows([heavy, neighbour]), torch.device("cpu"))
        pen = processors.penalties
        pairs_per_step.append(pen.output[0].numel() + pen.prompt[0].numel())
    # Every step: the heavy row's distinct output tokens and distinct prompt tokens, however long its history.
    assert max(pairs_per_step) == DISTINCT_OUTPUT + DISTINCT_PROMPT
    # Each output token was counted once over the request's life, not once per step (3000 x 1500 on average).
    assert heavy._output_counts.counted == steps


def test_incremental_counts_give_the_definitions_result():
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (300,), generator=g).tolist()
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=-0.3)
    seq = _sequence("r", params, prompt)
    for _ in range(200):
        seq.token_ids.append(int(torch.randint(0, VOCAB, (1,), generator=g)))
        rows = _step_rows([seq])
        logits = torch.randn(1, VOCAB, generator=g) * 3
        got = LogitsProcessors.build(rows, logits.device).apply(logits.clone())
        expected = reference_penalties(logits, [prompt], [seq.output_token_ids], [0.4], [-0.3], [1.7])
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert dict(seq.output_counts()) == Counter(seq.output_token_ids)
