"""bfloat16 on the CPU (AMX / AVX-512-BF16 through oneDNN where present) against transformers + peft
in bfloat16: greedy agreement and the top logprob within a stated tolerance, for adapter and base
rows in one batch. bf16 rounds differently from float32 and between implementations, so this is a
tolerance, not the float32 exact match the other engine tests demand."""
from __future__ import annotations

import pytest
import torch

from server.engine import LLM, SamplingParams

pytestmark = pytest.mark.unit

AGREEMENT = 0.95  # greedy tokens that transformers + peft picks too, teacher-forced on ours
LOGPROB_TOL = 0.1  # |top logprob difference|, nats


def test_bf16_cpu_matches_peft_within_tolerance(tiny_model_dir, tiny_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_model_dir, device="cpu", dtype="bfloat16", kv_cache_blocks=64, max_model_len=256)
    assert llm.engine.dtype == torch.bfloat16
    llm.add_adapter("r8", tiny_adapters["r8_all"])
    prompts = [[3 + i, 50 + i, 77, 9, 120 + i] for i in range(8)]
    names = ["r8", None] * 4
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0),
                        adapters=names)
    models = {None: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()}
    models["r8"] = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16), tiny_adapters["r8_all"]).eval()
    agree = total = 0
    worst = 0.0
    for prompt, name, out in zip(prompts, names, outs):
        with torch.inference_mode():
            logits = models[name](input_ids=torch.tensor([prompt + out.token_ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)  # [L, V]
        for j, token in enumerate(out.token_ids):
            row = logprobs[len(prompt) - 1 + j]
            agree += int(row.argmax()) == token
            total += 1
            worst = max(worst, abs(float(row.max()) - out.logprobs[j].logprob))
    print(f"bf16 CPU vs peft: greedy agreement {agree}/{total}, worst top-logprob difference {worst:.4f}")
    assert agree / total >= AGREEMENT, f"greedy agreement {agree}/{total}"
    assert worst <= LOGPROB_TOL, f"top logprob differs by {worst:.4f}"
