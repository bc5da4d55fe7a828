"""What the runner keeps from step to step for a plain decode row: its SamplingRow only when nothing reads
the row's output index (no seed), and one shared result per token only for a row that got nothing more
(which post-processing appends inline: tests/server/engine/test_output_processor.py); and the sampler's
path for a batch of plain greedy rows."""
import pytest
import torch

from server.engine.model_runner import TokenResults, _plain_row
from server.engine.sampler import SampleFailure, sample_rows
from server.engine.sampling_row import SamplingRow
from server.engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.unit


def test_an_unseeded_row_is_kept_and_a_seeded_one_is_not():
    plain = Sequence("a", [1, 2], SamplingParams(max_tokens=4), None, 0)
    row = _plain_row(plain, 0)
    assert plain.plain_row is row and (row.params, row.choice) == (plain.params, 0)
    seeded = Sequence("b", [1, 2], SamplingParams(max_tokens=4, temperature=1.0, seed=7), None, 1)
    assert _plain_row(seeded, 3).output_index == 3 and seeded.plain_row is None


def test_token_results_are_one_per_token():
    results = TokenResults()
    five = results[5]
    assert results[5] is five and (five.done, five.tokens, five.logprobs, five.drafted) == (True, (5,), (None,), 0)
    assert five.only_token
    failure = SampleFailure("produced non-finite logits", non_finite=True)
    assert results[failure].tokens == (failure,) and not results[failure].only_token


def test_a_plain_greedy_batch_fails_its_non_finite_rows_as_the_general_path_does():
    """sample_rows' plain greedy batch tells an all-finite batch by one scalar; a row with a NaN, +inf or
    -inf logit fails alone, and logits whose sum overflows (all finite) still give their argmax."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0))
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, 9] = float("-inf")
    logits[4] = torch.finfo(torch.float32).max  # ties: the first index
    logits[5, 11] = torch.finfo(torch.float32).max
    plain = SamplingRow(SamplingParams(temperature=0.0), 0, 0)
    general = SamplingRow(SamplingParams(temperature=0.0, logprobs=0), 0, 0)  # not plain: the general path
    fast = sample_rows(logits, [plain] * 6, torch.Generator())
    slow = sample_rows(logits, [general] * 6, torch.Generator())
    assert fast.tokens == slow.tokens and fast.logprobs == [None] * 6
    assert [isinstance(t, SampleFailure) for t in fast.tokens] == [False, True, True, True, False, False]
    assert fast.tokens[4] == 0 and fast.tokens[5] == 11
    finite = sample_rows(logits[[0, 4, 5]], [plain] * 3, torch.Generator()).tokens
    assert finite == [slow.tokens[0], 0, 11]
