"""StepCost's attention term: every earlier position, or at most the window where every layer has one."""
import pytest

from server.engine.scheduler import StepCost
from tests.server.engine.sequences import request

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("window", [None, 1, 4, 7, 30])
def test_a_chunk_attends_each_tokens_positions_up_to_the_window(window):
    seq = request(list(range(40)), 0)
    cost = StepCost(attention_per_position=1.0, window=window)
    for start in range(0, 12):
        for n in range(1, 15):
            attended = sum(min(p, window or p) for p in range(start + 1, start + n + 1))
            assert cost.chunk(seq, start, n) == n + attended, (start, n)
    if window is not None:  # past the window, a chunk costs the same however late it comes
        assert cost.chunk(seq, 100, 8) == cost.chunk(seq, 1000, 8) == 8 + 8 * window
