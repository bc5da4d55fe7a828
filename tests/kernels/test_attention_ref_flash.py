"""kernels/attention_ref.py's prompt paths (a whole prompt, a chunk over a long cached prefix) call SDPA with
a batch dimension, the rank on which a CPU runs the flash kernel rather than the math path (which repeats
GQA's K/V per head and materializes the scores and a float mask: most of a step's time for a short chunk
late in a long prompt), with results equal to the dense oracle."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from kernels import attention_ref
from tests.kernels.test_kernels_attention import dense_causal_attention, make_case

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("contexts, queries", [([300], [5]), ([0], [40]), ([0, 200, 7], [12, 3, 1])],
                         ids=["chunk-late", "whole-prompt", "mixed"])
def test_prompt_attention_takes_the_flash_kernel_and_matches_the_oracle(contexts, queries, monkeypatch):
    case = make_case(contexts, queries, block_size=16, hq=4, hkv=2, head_dim=32, dtype=torch.float32, seed=3)
    scale = 32 ** -0.5
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append(int(torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(attention_ref.F, "scaled_dot_product_attention", recorded)
    attention_ref.write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.batch.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    attention_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, scale, out)
    assert calls and all(c != int(SDPBackend.MATH) for c in calls)
    start = 0
    for n, k, v in zip(queries, case.k_full, case.v_full):
        dense = dense_causal_attention(case.q[start: start + n], k, v, scale)
        torch.testing.assert_close(out[start: start + n], dense, atol=2e-5, rtol=2e-5)
        start += n
