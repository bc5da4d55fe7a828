"""scripts/train_demo_adapters.py on the tiny model: the loss falls, and the adapter it writes loads in
PEFT and in loraplex with the same greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.scripts.script_module import script_module

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def trainer():
    return script_module("train_demo_adapters")


def test_generated_answers_carry_each_tasks_effect(trainer):
    import random

    rng = random.Random(0)
    french = trainer.examples("french", 4, rng)
    assert french[0][0].startswith(("What", "Which", "Name")) and french[0][1].startswith("La capitale")
    assert " font " in french[1][1]
    for _, reply in trainer.examples("json", 6, rng):
        assert set(json.loads(reply)) == {"answer"}
    assert all(reply.startswith("Arr,") for _, reply in trainer.examples("pirate", 4, rng))


def test_training_lowers_the_loss_and_the_adapter_serves_as_peft_runs_it(trainer, tiny_model_dir, tmp_path,
                                                                          peft_oracle):
    out = tmp_path / "json"
    losses = trainer.train(tiny_model_dir, "json", out, steps=24, batch_size=8, lr=3e-3, rank=4, seed=0)
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == trainer.BASE_MODEL_ID  # not the local dir it was trained on
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_blocks=32, max_model_len=128)
    llm.add_adapter("json", out)
    prompts = random_prompts(3, (6, 14), 512, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                        adapters=["json"] * 3)
    base = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, o in zip(prompts, outs):
        assert list(o.token_ids) == peft_oracle(tiny_model_dir, out, prompt, 6)
    assert [o.token_ids for o in outs] != [b.token_ids for b in base]  # the adapter changes something
