"""Serving one mixed batch at TP = N and at TP = 1 through the LLM API, and the float32 oracle's
logprobs, for the tensor-parallel engine tests."""
from __future__ import annotations

import pytest
import torch

from server.engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts

PARAMS = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logprobs=0)


def served(llm: LLM, adapters: dict, names: list, seed: int, params: SamplingParams = PARAMS) -> tuple[list, list]:
    """Each row's greedy tokens and their logprobs, `adapters` added first, prompts drawn from `seed`."""
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts = random_prompts(len(names), (3, 30), 512, seed=seed)
    outs = llm.generate(prompts, params, adapters=names)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def assert_tp_serves_as_tp1(model_dir, adapters: dict, kw: dict, names: list, seed: int, world_size: int = 2,
                            **tp_kw) -> tuple[LLM, list, list]:
    """TP = world_size (tp_kw on top of kw) and TP = 1 (kw) on a batch of `names`' rows: the same tokens,
    logprobs within 1e-4. Returns the TP engine's LLM, shut down, for what its rank 0 kept, and its
    tokens and logprobs."""
    llm = LLM(model_dir, tensor_parallel_size=world_size, **kw, **tp_kw)
    try:
        tokens, logprobs = served(llm, adapters, names, seed)
    finally:
        llm.engine.shutdown()
    want_tokens, want_logprobs = served(LLM(model_dir, **kw), adapters, names, seed)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-4)
    return llm, tokens, logprobs


def peft_logprobs(model_dir, adapter_dir, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each generated token's logprob under transformers (+ peft) in float32, teacher-forced."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    n = len(prompt)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(tokens)]


def assert_tp_matches_peft(model_dir, adapters: dict, names: list, seed: int, tokens: list, logprobs: list,
                           peft_oracle) -> None:
    """The rows served() drew from `seed` generated transformers + peft's greedy tokens, logprobs within 1e-4."""
    prompts = random_prompts(len(names), (3, 30), 512, seed=seed)
    for prompt, name, got_tokens, got_logprobs in zip(prompts, names, tokens, logprobs):
        adapter = adapters[name] if name else None
        assert got_tokens == peft_oracle(model_dir, adapter, prompt, PARAMS.max_tokens), name
        assert got_logprobs == pytest.approx(peft_logprobs(model_dir, adapter, prompt, got_tokens), abs=1e-4), name
