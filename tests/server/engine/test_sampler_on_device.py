"""Sampling stays where the logits are (issue 12, item 9): no vocabulary-sized tensor is ever copied
to the host. On a GPU that copy (and a host-side sort) per sampled row is what the old sampler did;
here every host transfer (.cpu(), .tolist(), .item(), .numpy()) is recorded and must be batch-sized."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from server.engine.sampler import SamplingRow, sample_rows
from server.engine.sequence import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 4096


def test_no_vocabulary_sized_host_transfer(monkeypatch):
    sizes: list[int] = []
    for name in ("cpu", "tolist", "item", "numpy"):
        original = getattr(torch.Tensor, name)

        def recording(self, *args, _original=original, **kwargs):
            sizes.append(self.numel())
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, recording)
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [N, V]
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, 0),
            SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), 0, 3),
            SamplingRow(SamplingParams(temperature=1.0, top_k=40, seed=7), 1, 2),
            SamplingRow(SamplingParams(temperature=1.2, min_p=0.05, logprobs=5), 0, 1),
            SamplingRow(SamplingParams(temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5,
                                       repetition_penalty=1.3, logit_bias={5: 10.0}), 0, 4, Counter((5, 9, 9)),
                        torch.tensor([1, 2, 3])),
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.5, seed=3), 2, 0)]
    out = sample_rows(logits, rows, torch.Generator().manual_seed(1))
    assert all(isinstance(t, int) for t in out.tokens) and out.logprobs[3] is not None
    assert sizes, "expected a few batch-sized transfers (the chosen tokens)"
    assert max(sizes) < VOCAB, f"a {max(sizes)}-element tensor went to the host"
