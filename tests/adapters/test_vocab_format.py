"""adapters.vocab_format: PEFT's LoRA on embed_tokens and lm_head and its modules_to_save copies, as parsed,
bounded and refused; what the engine makes of them is checked against PEFT in
tests/server/engine/test_engine_vocab_parts.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from adapters.format import AdapterFormatError, ModelShape, inspect_adapter_bytes, load_adapter_bytes, load_adapter_dir
from adapters.loader_pool import LoaderPool
from adapters.vocab_format import from_wire, to_wire
from tests.vocab_adapters import make_vocab_adapter

pytestmark = pytest.mark.unit

MAX_RANK = 16


@pytest.fixture(scope="module")
def shape(tiny_model_dir) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, tiny_model_dir):
    return make_vocab_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora"),
                              target_modules=["q_proj", "embed_tokens", "lm_head"], r=4, seed=1)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, tiny_model_dir):
    return make_vocab_adapter(tiny_model_dir, tmp_path_factory.mktemp("saved"), target_modules=["q_proj"],
                              modules_to_save=["embed_tokens", "lm_head"], seed=2)


def files(path) -> tuple[bytes, bytes]:
    return (path / "adapter_config.json").read_bytes(), (path / "adapter_model.safetensors").read_bytes()


def test_lora_parts_scaling_and_canonical_config(lora_dir, shape):
    adapter = load_adapter_dir(lora_dir, shape, MAX_RANK)
    v = adapter.vocab
    assert v.embed_lora.a.shape == (4, 512) and v.embed_lora.b.shape == (64, 4) and v.embed_lora.scaling == 2.0
    assert v.lm_head_lora.a.shape == (4, 64) and v.lm_head_lora.b.shape == (512, 4)
    # PEFT saves the base's embedding and lm_head beside a LoRA on them: held as the adapter's copies
    assert v.embed.shape == v.lm_head.shape == (512, 64)
    assert adapter.target_modules == ("embed_tokens", "lm_head", "q_proj")
    summary = inspect_adapter_bytes(*files(lora_dir), shape, MAX_RANK)
    parts = 4 * (4 * (512 + 64) * 2 + 2 * 512 * 64)
    assert summary.size_bytes == 4 * 2 * 4 * (64 + 64) + parts
    again = load_adapter_bytes(summary.canonical_config_json, files(lora_dir)[1], shape, MAX_RANK)
    assert json.loads(summary.canonical_config_json)["target_modules"][-2:] == ["model.embed_tokens", "lm_head"]
    for a, b in zip(again.vocab.tensors(), v.tensors()):
        assert torch.equal(a, b)


def test_modules_to_save_copies(saved_dir, shape):
    v = load_adapter_dir(saved_dir, shape, MAX_RANK).vocab
    assert v.embed_lora is None and v.lm_head_lora is None and v.embed.shape == v.lm_head.shape == (512, 64)


def test_the_byte_bound_refuses_naming_the_flag(saved_dir, shape):
    copy = 4 * 512 * 64
    load_adapter_dir(saved_dir, dataclasses.replace(shape, max_vocab_bytes=2 * copy), MAX_RANK)
    with pytest.raises(AdapterFormatError, match=rf"lm_head and model.embed_tokens take {2 * copy} bytes .*"
                                                 rf"bound of {2 * copy - 1} \(--max-lora-vocab-bytes\)"):
        inspect_adapter_bytes(*files(saved_dir), dataclasses.replace(shape, max_vocab_bytes=2 * copy - 1), MAX_RANK)


def test_a_resized_vocabulary_is_refused_naming_the_tensor(tmp_path, tiny_model_dir, shape):
    grown = make_vocab_adapter(tiny_model_dir, tmp_path / "grown", target_modules=["q_proj"],
                               modules_to_save=["embed_tokens", "lm_head"], resize_vocab=520)
    with pytest.raises(AdapterFormatError, match=r"has a vocabulary of 520 rows but the base model's is 512: a "
                                                 "resized vocabulary is not served"):
        inspect_adapter_bytes(*files(grown), shape, MAX_RANK)


def test_parts_cross_the_loader_process_wire(lora_dir, shape):
    vocab = load_adapter_dir(lora_dir, shape, MAX_RANK).vocab
    entries, tensors = to_wire(vocab)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    at = 0

    def take(*dims: int) -> torch.Tensor:
        nonlocal at
        at += math.prod(dims)
        return flat[at - math.prod(dims): at].view(*dims)

    back = from_wire(json.loads(json.dumps(entries)), take)
    assert at == flat.numel() and back.embed_lora.scaling == vocab.embed_lora.scaling
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), vocab.tensors()))


def test_a_loader_process_parse_brings_the_parts_back(lora_dir, saved_dir, shape):
    """The host tier's page-in of a stored version in a loader process (adapters.loader_pool)."""
    pool = LoaderPool(1, 1 << 22)
    try:
        for path in (lora_dir, saved_dir):
            config_json, weights = files(path)
            ours = pool.parse(config_json, weights, shape, MAX_RANK, path.name)
            theirs = load_adapter_bytes(config_json, weights, shape, MAX_RANK)
            assert ours.size_bytes == theirs.size_bytes and ours.target_modules == theirs.target_modules
            assert len(ours.vocab.tensors()) == len(theirs.vocab.tensors())
            assert all(torch.equal(a, b) for a, b in zip(ours.vocab.tensors(), theirs.vocab.tensors()))
    finally:
        pool.close()
