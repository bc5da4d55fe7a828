"""Logprobs as OpenAI reports them: of the model's own distribution (log_softmax of the raw
logits, the request's adapter applied), before bias, penalties or temperature."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from server.engine.sequence import TokenLogprobs


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, top: Sequence[int]) -> list[TokenLogprobs]:
    """Per row: the target token's logprob and the row's `top[j]` most likely tokens.

    logits: [M, V] raw; targets: [M] token ids; top: M counts (0..20). One log_softmax and
    one topk for the whole batch, at the largest count asked for.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    chosen = logprobs.gather(1, targets.to(logprobs.device)[:, None]).squeeze(1).tolist()  # [M]
    k = max(top, default=0)
    if k == 0:
        return [TokenLogprobs(t, c, ()) for t, c in zip(targets.tolist(), chosen)]
    values, ids = logprobs.topk(k, dim=-1)  # [M, k] each, most likely first
    values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(t, c, tuple(zip(ids[j][: top[j]], values[j][: top[j]])))
        for j, (t, c) in enumerate(zip(targets.tolist(), chosen))
    ]
