"""What the runner keeps from step to step for a plain decode row: its SamplingRow only when nothing reads
the row's output index (no seed), and one shared result per token only for a row that got nothing more."""
import pytest

from server.engine.model_runner import TokenResults, _plain_row
from server.engine.sampler import SampleFailure
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
    failure = SampleFailure("produced non-finite logits", non_finite=True)
    assert results[failure].tokens == (failure,)
