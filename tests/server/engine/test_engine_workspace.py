"""The forward writes its projections into the model's preallocated workspace instead of new tensors.

Why it matters: on CPU, glibc serves blocks over 32 MB from fresh mmaps, so a prefill-sized output
allocated per layer page-faults on every layer (server/engine/model.py, Workspace). Correctness with the
reused buffers is the PEFT parity suite's; this checks the allocations themselves.
"""
from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from server.engine import LLM, SamplingParams

pytestmark = pytest.mark.unit


def test_prefill_projections_allocate_nothing(tiny_model_dir, tiny_adapters) -> None:
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=256, max_lora_rank=8)
    llm.add_adapter("a", tiny_adapters[next(iter(tiny_adapters))])
    ws = llm.engine.model.workspace
    cfg = llm.engine.model.cfg
    assert ws.max_tokens == 256 and ws.gate_up.shape == (256, 2 * cfg.intermediate_size)
    prompts = [[5 + i] * 100 for i in range(2)]  # one 200-token prefill step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), adapters=["a", None])
    assert all(len(o.token_ids) == 1 for o in outs)
    matmuls = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
    projections = [e for e in matmuls if e.input_shapes[0][:1] == [200] or e.input_shapes[1][:1] == [200]]
    assert len(projections) == 4 * cfg.num_layers  # qkv, o, gate_up, down in each layer
    assert [e.cpu_memory_usage for e in projections] == [0] * len(projections)
    silu_times_up = [e for e in prof.events() if e.name == "aten::mul"
                     and e.input_shapes[:2] == [[200, cfg.intermediate_size]] * 2]
    assert len(silu_times_up) == cfg.num_layers and all(e.cpu_memory_usage == 0 for e in silu_times_up)
    # The lm_head's logits are the one matmul that allocates: a new [sampled rows, V] tensor.
    assert sum(e.cpu_memory_usage > 0 for e in matmuls) == 1


def test_a_step_after_a_larger_one_is_unchanged(tiny_model_dir) -> None:
    """Rows a large step left in the workspace never leak into a smaller step's results."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    alone = LLM(str(tiny_model_dir), max_num_batched_tokens=256).generate([[7, 8, 9]], params)[0]
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=256)
    llm.generate([[3 + i % 50 for i in range(230)]], SamplingParams(max_tokens=2, temperature=0.0))
    after = llm.generate([[7, 8, 9]], params)[0]
    assert after.token_ids == alone.token_ids
    assert after.logprobs == alone.logprobs  # bit for bit: same floats, same top tokens
