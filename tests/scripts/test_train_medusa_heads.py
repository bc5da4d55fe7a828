"""scripts/train_medusa_heads.py on the tiny model: the loss falls, the heads guess the model's own tokens
far above chance on held-out positions, and what it writes loads as heads of that model."""
from __future__ import annotations

import json
import random

import pytest

from adapters.medusa_format import read_heads_dir
from tests.scripts.script_module import script_module

pytestmark = pytest.mark.unit

@pytest.fixture(scope="module")
def trainer():
    return script_module("train_medusa_heads")


@pytest.mark.parametrize("adapter", [None, "r8_all"])
def test_heads_learn_the_models_own_continuations(trainer, tiny_model_dir, tiny_adapters, tmp_path, adapter):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 30))] for _ in range(32)]
    out = tmp_path / "heads"
    doc = trainer.train(tiny_model_dir, out, prompts, adapter=tiny_adapters[adapter] if adapter else None,
                        num_heads=3, max_tokens=32, steps=150, log=lambda line: None)
    loss = doc["loss"]
    assert sum(loss[-20:]) / 20 < sum(loss[:20]) / 20
    assert min(doc["held_out_top1_accuracy"]) > 5 / 512  # chance is 1 in 512: each head does 5 times better
    heads = read_heads_dir(out, 64, 512, min_heads=3)
    assert heads.num_heads == 3
    assert json.loads((out / "train_log.json").read_text())["adapter"] == (str(tiny_adapters[adapter]) if adapter else None)


def test_default_prompts_are_not_evaluation_items(trainer):
    from server.bench.eval_items import load_items

    questions = {item.question for item in load_items()}
    prompts = trainer.default_prompts()
    assert len(prompts) == len(set(prompts)) >= 200 and not questions & set(prompts)
