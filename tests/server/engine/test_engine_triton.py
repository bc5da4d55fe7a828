"""End to end through the Triton kernels (under the interpreter on CPU): still PEFT's tokens."""
from __future__ import annotations

import os

import pytest
import torch

from server.engine import LLM
from tests.engine_helpers import assert_matches_peft, greedy, random_prompts

pytestmark = [pytest.mark.unit, pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or the interpreter",
)]


def test_triton_kernels_match_peft_for_mixed_batch(tiny_model_dir, tiny_adapters, peft_oracle):
    # Real launches on a GPU machine, the interpreter on CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(tiny_model_dir, device=device, dtype="float32", kernels="triton", max_loras=2,
              kv_cache_blocks=32, max_model_len=128, block_size=16)
    assert llm.engine.kernels.name == "triton"
    for name in ("r8_all", "r4_qv"):
        llm.add_adapter(name, tiny_adapters[name])
    # A prompt of 20 tokens spans two blocks; the mix covers both LoRA paths (segmented prefill,
    # gathered decode), a base row, and two ranks.
    names = ["r8_all", None, "r4_qv"]
    prompts = random_prompts(3, (6, 20), 512, seed=41)
    outs = llm.generate(prompts, greedy(4), adapters=names)
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 4, peft_oracle)


def test_auto_picks_torch_on_cpu(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=64)
    assert llm.engine.kernels.name == "torch"
