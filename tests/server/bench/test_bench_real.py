"""`python -m benchmarks.serving.bench --workload real`: the mixed trace with evaluation questions in SmolLM2's chat
template as prompts, and the shipped demo adapters behind the bench's adapter names."""
from __future__ import annotations

import pytest

from server.bench.eval_items import load_items
from server.bench.real_workload import real_adapters, real_prompts
from server.bench.runner import BenchConfig
from server.bench.workload import adapter_name, generate_workload


def test_real_prompts_are_questions_in_the_chat_template_and_keep_the_trace(default_model_dir):
    from transformers import AutoTokenizer

    cfg = BenchConfig(adapter_counts=(3,), num_requests=12, workload_type="real", model_dir=str(default_model_dir))
    trace = generate_workload(cfg.workload(3, 49152))
    reqs = real_prompts(trace, default_model_dir, seed=0)
    assert [(r.arrival_s, r.adapter, r.tenant, r.max_tokens) for r in reqs] == \
        [(r.arrival_s, r.adapter, r.tenant, r.max_tokens) for r in trace]
    text = AutoTokenizer.from_pretrained(default_model_dir).decode(reqs[0].prompt_ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    assert question in {i.question for i in load_items()}
    assert real_prompts(trace, default_model_dir, seed=0) == reqs
    assert real_prompts(trace, default_model_dir, seed=1) != reqs


def test_bench_adapters_map_onto_the_shipped_ones_in_turn(tmp_path):
    for name in ("french", "json"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    named = real_adapters([0, 1, 2, 5], tmp_path)
    assert named == {adapter_name(0): tmp_path / "french", adapter_name(1): tmp_path / "json",
                     adapter_name(2): tmp_path / "french", adapter_name(5): tmp_path / "json"}
    with pytest.raises(ValueError, match="train_demo_adapters"):
        real_adapters([0], tmp_path / "none")
