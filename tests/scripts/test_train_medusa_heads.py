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
    assert heads.num_heads == 3 and heads.draft_vocab is None  # the default 8192 ids: the whole tiny vocabulary
    assert json.loads((out / "train_log.json").read_text())["adapter"] == (str(tiny_adapters[adapter]) if adapter else None)


def test_default_prompts_are_not_evaluation_items(trainer):
    from server.bench.eval_items import load_items

    questions = {item.question for item in load_items()}
    prompts = trainer.default_prompts()
    assert len(prompts) == len(set(prompts)) >= 200 and not questions & set(prompts)


def test_the_draft_vocabulary_is_the_answers_tokens_most_frequent_first_then_the_lowest_ids(trainer):
    prompts = [[1, 2], [3]]
    sequences = [[1, 2, 9, 7, 9], [3, 7, 9, 5]]  # answers: 9 x3, 7 x2, 5 x1
    assert trainer.draft_vocab(sequences, prompts, 16, 5).tolist() == [9, 7, 5, 0, 1]
    assert trainer.draft_vocab(sequences, prompts, 16, 2).tolist() == [9, 7]
    assert trainer.draft_vocab(sequences, prompts, 16, 0) is None and trainer.draft_vocab(sequences, prompts, 16, 16) is None


def test_a_draft_vocabulary_is_written_with_the_heads_and_added_to_trained_ones(trainer, tiny_model_dir, tmp_path):
    """Heads trained with a draft vocabulary carry it, their held-out accuracy is over it; --add-draft-vocab
    gives heads trained without one the same vocabulary, their weights untouched."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 30))] for _ in range(20)]
    opts = dict(num_heads=2, max_tokens=16, steps=20, log=lambda line: None)
    with_vocab = trainer.train(tiny_model_dir, tmp_path / "a", prompts, draft_vocab_size=100, **opts)
    without = trainer.train(tiny_model_dir, tmp_path / "b", prompts, draft_vocab_size=0, **opts)
    assert with_vocab["draft_vocab"] == 100 and without["draft_vocab"] is None
    a, b = (read_heads_dir(tmp_path / d, 64, 512) for d in "ab")
    assert len(a.draft_vocab) == 100 and b.draft_vocab is None
    added = trainer.add_draft_vocab(tiny_model_dir, tmp_path / "b", prompts, max_tokens=16, draft_vocab_size=100,
                                    log=lambda line: None)
    b2 = read_heads_dir(tmp_path / "b", 64, 512)
    assert b2.draft_vocab.tolist() == a.draft_vocab.tolist() and bool((b2.weight == b.weight).all())
    assert added["held_out_top1_accuracy_full_vocab"] == without["held_out_top1_accuracy"]
