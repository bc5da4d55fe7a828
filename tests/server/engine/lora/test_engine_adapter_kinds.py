"""The four kinds of rows in one batch: base, plain LoRA, DoRA and activated LoRA (issue 28's target):
64 requests, greedy tokens equal transformers + peft's and logprobs within 1e-4 (float32), with
prompts long enough to be prefilled in chunks beside decodes and half the aLoRA prompts holding
their invocation sequence (the other half run wholly as the base model, as PEFT does)."""
from __future__ import annotations

import random

import pytest
import torch

from adapters.activation import NOT_INVOKED, activation_start
from server.engine import LLM, SamplingParams
from tests.fixtures_models import TINY_DORA_ADAPTERS
from tests.hostile_helpers import tampered_adapter
from tests.server.engine.test_engine_logprobs import assert_matches

pytestmark = pytest.mark.unit

VOCAB = 512
INVOCATION = [7, 8, 9]
KINDS = (None, "r4_qv", "r8_all", *tuple(TINY_DORA_ADAPTERS)[:2], "alora")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_adapters, tiny_dora_adapters, tmp_path_factory):
    alora = tampered_adapter(tiny_adapters["r16_rslora"], tmp_path_factory.mktemp("kinds") / "alora",
                             config={"alora_invocation_tokens": INVOCATION})
    return {**tiny_adapters, **tiny_dora_adapters, "alora": alora}


def _prompt(i: int) -> list[int]:
    """3..70 ids of 10.. (no invocation token); every other aLoRA prompt gets the invocation inside."""
    rng = random.Random(1000 + i)
    ids = [rng.randrange(10, VOCAB) for _ in range(rng.randrange(3, 70))]
    if KINDS[i % len(KINDS)] == "alora" and (i // len(KINDS)) % 2 == 0:
        at = rng.randrange(0, len(ids) + 1)
        ids[at:at] = INVOCATION
    return ids


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dirs):
    """reference(name, prompt, ids) -> [len(ids), V]: log_softmax of transformers (+ peft) float32 logits,
    the aLoRA applied from its activation point in `prompt` on (PEFT's alora_offsets), or nowhere."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict = {}

    @torch.inference_mode()
    def get(name, prompt, ids):
        if name not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, adapter_dirs[name])
            models[name] = model.eval()
        kwargs = {}
        if name == "alora":
            start = activation_start(INVOCATION, prompt)
            kwargs["alora_offsets"] = [None if start == NOT_INVOKED else len(ids) - start]
        return torch.log_softmax(models[name](input_ids=torch.tensor([ids]), **kwargs).logits[0].float(), dim=-1)

    return get


def test_64_requests_mixing_base_lora_dora_and_alora_match_peft(tiny_model_dir, adapter_dirs, reference):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=8, kv_cache_blocks=256, max_model_len=256,
              max_num_batched_tokens=64, block_size=16)
    for name in KINDS[1:]:
        llm.add_adapter(name, adapter_dirs[name])
    names = [KINDS[i % len(KINDS)] for i in range(64)]
    prompts = [_prompt(i) for i in range(64)]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outs = llm.generate(prompts, p, adapters=names)
    invoked = 0
    for prompt, name, out in zip(prompts, names, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
        assert_matches(out, prompt, p, reference(name, prompt, prompt + out.token_ids))
        invoked += name == "alora" and activation_start(INVOCATION, prompt) != NOT_INVOKED
    assert invoked >= 4
    assert llm.engine.stats().kv_blocks.used == 0
