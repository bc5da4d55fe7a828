"""row_max gives what logits.max(dim=-1) gives: the max and the first index holding it, ties included."""
import pytest
import torch

from server.engine.row_max import MIN_WIDTH, row_max

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("width", [8, MIN_WIDTH, MIN_WIDTH + 1, 5000, 32003])
def test_row_max_matches_max_with_indices(width):
    g = torch.Generator().manual_seed(width)
    ties = torch.randint(0, 5, (37, width), generator=g).float()  # many equal maxima per row
    ties[3] = float("-inf")
    ties[4, 7] = float("inf")
    ties[6] = 0.0
    ties[7, -1] = 10.0  # the max in the short last block
    ties[8, 0] = 10.0
    for logits in (ties, torch.randn(37, width, generator=g), torch.randn(width, 37, generator=g).t()):
        best, index = logits.max(dim=-1)
        got_best, got_index = row_max(logits)
        assert torch.equal(got_index, index)
        assert torch.equal(got_best, best)


def test_row_max_nan_row_gives_nan():
    logits = torch.randn(4, 5000)
    logits[2, 1234] = float("nan")
    best, _ = row_max(logits)
    assert torch.isnan(best[2]) and not torch.isnan(best[[0, 1, 3]]).any()
