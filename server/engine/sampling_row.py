"""One token to choose: what the sampler (sampler.py: the logit modifications, truncation and the draw)
reads of each row; the model runner builds the rows."""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from server.engine.sequence import SamplingParams


class SamplingRow(NamedTuple):
    """One token to choose: a choice of a request, at one output position."""

    params: SamplingParams
    choice: int  # the choice's index in its request (seeds a stream of its own)
    # Index in the choice's output of the token being chosen; read only by a seeded draw and min_tokens (a
    # row with neither is built once per sequence and keeps the index it was built at: Sequence.plain_row).
    output_index: int
    # The choice's output so far as token -> count (server.engine.token_counts); read only with a penalty.
    output_counts: Mapping[int, int] = {}
    prompt_ids: torch.Tensor | None = None  # [P] CPU, distinct ones suffice; read only with a repetition penalty
    stop_ids: tuple[int, ...] = ()  # masked while output_index < min_tokens
    grammar: object | None = None  # the choice's LaneMatcher (server.engine.mask_lane), when constrained
