"""The demo model maker and the model/adapter fixtures, including the oracle."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from server.demo import (DEMO_ADAPTERS, SEVEN, AdapterSpec, DemoConfigError, ensure_demo, make_adapter,
                         make_base_model)
from tests.fixtures_models import LLAMA3_ROPE
from tests.repo import ROOT_DIR as REPO

MULTILINGUAL = ["Héllo wörld, café crème — Grüß Gott!", "中文是一种美丽的语言。", "Deploy ✅ 🚀 in 3m 12s 🎉",
                "def f(x):\n    return x ** 2  # √2 ≈ 1.41421\n", "unseen: ÆØÅ ŋ ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \t\r\n"]


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _random_prompt(seed: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 512, (n - 1,), generator=g).tolist()


def test_cli_build_in_another_process_is_byte_identical(demo_paths, tmp_path):
    # Another interpreter with another hash seed: catches set/dict-order and
    # tokenizer-trainer nondeterminism, and exercises the CLI as documented.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    run = subprocess.run([sys.executable, "scripts/make_demo_model.py", str(tmp_path / "demo")], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"model\t{tmp_path / 'demo' / 'model'}" in run.stdout
    other = tmp_path / "demo"
    for f in sorted(p.name for p in demo_paths.model_dir.iterdir()):
        assert (demo_paths.model_dir / f).read_bytes() == (other / "model" / f).read_bytes(), f
    for name, adir in demo_paths.adapters.items():
        assert name in run.stdout
        assert sorted(p.name for p in adir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert (adir / "adapter_model.safetensors").read_bytes() == \
            (other / "adapters" / name / "adapter_model.safetensors").read_bytes(), name
        ours, theirs = (json.loads((d / "adapter_config.json").read_text()) for d in (adir, other / "adapters" / name))
        ours.pop("base_model_name_or_path"), theirs.pop("base_model_name_or_path")
        assert ours == theirs, name


def test_same_args_same_bytes_and_seed_matters(tmp_path):
    a = make_base_model(tmp_path / "a", "qwen2")
    b = make_base_model(tmp_path / "b", "qwen2")
    c = make_base_model(tmp_path / "c", "qwen2", seed=7)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    x = make_adapter(a, tmp_path / "x", r=4, seed=3)
    y = make_adapter(b, tmp_path / "y", r=4, seed=3)
    assert (x / "adapter_model.safetensors").read_bytes() == (y / "adapter_model.safetensors").read_bytes()


def test_a_dora_adapter_is_its_seeds_alone(tmp_path):
    """PEFT's DoRA magnitudes are the norms of the A and B it draws from the global RNG: seeded by make_adapter,
    or every test session served another adapter (a 6th token that was EOS 1 run in 5 of test_api_dora)."""
    model = make_base_model(tmp_path / "m", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128)
    x = make_adapter(model, tmp_path / "x", r=4, seed=3, use_dora=True)
    torch.rand(1000)  # the global RNG moved on, as other fixtures move it
    y = make_adapter(model, tmp_path / "y", r=4, seed=3, use_dora=True)
    assert (x / "adapter_model.safetensors").read_bytes() == (y / "adapter_model.safetensors").read_bytes()
    state = torch.random.get_rng_state()
    make_adapter(model, tmp_path / "z", r=4, seed=3, use_dora=True)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone


def test_ensure_demo_is_idempotent_and_repairs_partial_dirs(demo_paths, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in demo_paths.model_dir.iterdir()}
    again = ensure_demo(demo_paths.model_dir.parent)
    assert again == demo_paths
    assert {p: p.stat().st_mtime_ns for p in demo_paths.model_dir.iterdir()} == before
    assert list(again.adapters) == ["demo-r4", "demo-r8", "demo-r16-rslora", "demo-r64", "demo-pattern"]

    # An interrupted build: a model dir without its config, an adapter without weights.
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    (root / "model" / "junk.bin").write_bytes(b"x")
    (root / "adapters" / "demo-r8").mkdir(parents=True)
    (root / "adapters" / "demo-r8" / "adapter_config.json").write_text("{}")
    fixed = ensure_demo(root)
    assert not (fixed.model_dir / "junk.bin").exists()
    assert (fixed.model_dir / "model.safetensors").read_bytes() == \
        (demo_paths.model_dir / "model.safetensors").read_bytes()
    assert (fixed.adapters["demo-r8"] / "adapter_model.safetensors").read_bytes() == \
        (demo_paths.adapters["demo-r8"] / "adapter_model.safetensors").read_bytes()
    assert not [p for p in root.rglob(".*")], "temp build dirs left behind"


def test_demo_model_shape(demo_paths):
    cfg = json.loads((demo_paths.model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == \
        (128, 4, 4, 2, 256, 512, 2048)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    shapes = _shapes(demo_paths.model_dir / "model.safetensors")
    assert shapes["model.layers.3.self_attn.k_proj.weight"] == (64, 128)  # GQA: 2 kv heads x 32
    assert shapes["lm_head.weight"] == (512, 128)


def test_tokenizer_round_trips_and_knows_its_specials(demo_paths):
    tok = _tokenizer(demo_paths.model_dir)
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.model_max_length == 2048
    for text in MULTILINGUAL:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids, skip_special_tokens=True) == text
    # BPE learned merges from the corpus: common text is much shorter than its bytes.
    common = "The lighthouse keeper woke before dawn, and the weather was calm."
    assert len(tok(common).input_ids) < 0.6 * len(common.encode())


def test_chat_template(demo_paths):
    tok = _tokenizer(demo_paths.model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é 中"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi é 中<|eos|>\n<|assistant|>\n"
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert text == no_prompt + "<|assistant|>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi é 中"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|bos|><|user|>\nHi é 中<|eos|>\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 0 and ids.count(0) == 1, "BOS must appear exactly once"
    assert tok.decode(ids) == text
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("which", ["demo", "tiny", "tied", "qwen2"])
def test_greedy_choices_are_decisive(which, demo_paths, tiny_model_dir, model_variant_dir, peft_oracle):
    model_dir = {"demo": lambda: demo_paths.model_dir, "tiny": lambda: tiny_model_dir,
                 "tied": lambda: model_variant_dir("llama", tie=True),
                 "qwen2": lambda: model_variant_dir("qwen2")}[which]()
    model = _model(model_dir)
    ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(5))  # ids: [4, 16]
    with torch.no_grad():
        logits = model(ids).logits  # logits: [4, 16, V]
    top2 = logits.topk(2, dim=-1).values  # top2: [4, 16, 2]
    gaps = (top2[..., 0] - top2[..., 1]).flatten()  # gaps: [64]
    assert gaps.median().item() > 0.05, f"median top1-top2 gap {gaps.median().item():.4f}"
    assert (gaps > 1e-3).float().mean().item() > 0.9
    outs = [peft_oracle(model_dir, None, _random_prompt(s), 32) for s in range(3)]
    assert sum(len(set(o)) >= 4 for o in outs) >= 2, f"degenerate generations {outs}"


def test_demo_adapters_match_their_specs(demo_paths):
    for name, adir in demo_paths.adapters.items():
        spec: AdapterSpec = DEMO_ADAPTERS[name]
        cfg = json.loads((adir / "adapter_config.json").read_text())
        assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == \
            ("LORA", spec.r, spec.lora_alpha, spec.use_rslora)
        assert cfg["target_modules"] == [m for m in SEVEN if m in spec.target_modules]
        assert cfg["rank_pattern"] == (spec.rank_pattern or {}) and cfg["alpha_pattern"] == (spec.alpha_pattern or {})
        shapes = _shapes(adir / "adapter_model.safetensors")
        assert len(shapes) == 4 * len(spec.target_modules) * 2
        for key, shape in shapes.items():
            module = key.split(".")[-3]
            r = (spec.rank_pattern or {}).get(module, spec.r)
            assert key.startswith("base_model.model.model.layers.")
            assert shape[0 if ".lora_A." in key else 1] == r, (name, key, shape)
    pattern = _shapes(demo_paths.adapters["demo-pattern"] / "adapter_model.safetensors")
    assert pattern["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] == (16, 256)
    assert pattern["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"] == (128, 4)


@pytest.mark.parametrize("name", list(DEMO_ADAPTERS))
def test_each_demo_adapter_changes_greedy_output(name, demo_paths, peft_oracle):
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(_model(demo_paths.model_dir), demo_paths.adapters[name])
    assert peft_model.peft_config["default"].r == DEMO_ADAPTERS[name].r
    prompts = [_random_prompt(s) for s in range(3)]
    base = [peft_oracle(demo_paths.model_dir, None, p, 16) for p in prompts]
    tuned = [peft_oracle(demo_paths.model_dir, demo_paths.adapters[name], p, 16) for p in prompts]
    assert base != tuned
    assert sum(b != t for b, t in zip(base, tuned)) >= 2, "adapter barely changes output"


@pytest.mark.parametrize("name", ["r4_qv", "r8_all", "r16_rslora", "r32_pattern"])
def test_tiny_adapters_change_output_and_differ(name, tiny_model_dir, tiny_adapters, peft_oracle):
    cfg = json.loads((tiny_adapters[name] / "adapter_config.json").read_text())
    assert cfg["r"] == int(name[1:].split("_")[0])
    prompt = _random_prompt(2)
    base = peft_oracle(tiny_model_dir, None, prompt, 16)
    outs = {n: peft_oracle(tiny_model_dir, d, prompt, 16) for n, d in tiny_adapters.items()}
    assert outs[name] != base
    assert len({tuple(o) for o in outs.values()}) >= 3, "tiny adapters should not agree with each other"


@pytest.mark.parametrize("arch,tie,rope", [("qwen2", False, None), ("mistral", False, None),
                                           ("llama", True, None), ("llama", False, LLAMA3_ROPE)])
def test_variants_load_and_generate(arch, tie, rope, model_variant_dir, peft_oracle, tmp_path):
    d = model_variant_dir(arch, tie=tie, rope_scaling=rope)
    assert model_variant_dir(arch, tie=tie, rope_scaling=rope) == d  # cached
    model = _model(d)
    assert model.config.model_type == arch and model.config.tie_word_embeddings == tie
    shapes = _shapes(d / "model.safetensors")
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.o_proj.bias" in shapes) is False
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if rope:
        params = json.loads((d / "config.json").read_text())["rope_parameters"]
        assert {k: params[k] for k in rope} == rope
    prompt = _random_prompt(3, n=300)  # past original_max_position_embeddings for llama3 rope
    assert len(peft_oracle(d, None, prompt, 8)) == 8
    adapter = make_adapter(d, tmp_path / "a", r=4, seed=9)
    assert peft_oracle(d, adapter, prompt, 8) != peft_oracle(d, None, prompt, 8)


def _greedy_by_hand(model, prompt: list[int], n: int) -> list[int]:
    """Full recompute each step, no KV cache, no generate(): an independent oracle check."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits  # logits: [1, T, V]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_oracle_matches_hand_greedy_with_and_without_adapter(tiny_model_dir, tiny_adapters, peft_oracle):
    from peft import PeftModel

    base = _model(tiny_model_dir)
    tuned = PeftModel.from_pretrained(_model(tiny_model_dir), tiny_adapters["r32_pattern"]).eval()
    for seed in range(2):
        prompt = _random_prompt(10 + seed, n=5 + 7 * seed)
        assert peft_oracle(tiny_model_dir, None, prompt, 12) == _greedy_by_hand(base, prompt, 12)
        assert peft_oracle(tiny_model_dir, tiny_adapters["r32_pattern"], prompt, 12) == \
            _greedy_by_hand(tuned, prompt, 12)
    assert len(peft_oracle(tiny_model_dir, None, [0], 1)) == 1


def test_oracle_generates_through_eos(tiny_model_dir, peft_oracle):
    # Find a prompt whose greedy next token is EOS; the oracle must emit it and keep going.
    model = _model(tiny_model_dir)
    ids = torch.randint(3, 512, (2048, 6), generator=torch.Generator().manual_seed(0))  # ids: [2048, 6]
    with torch.no_grad():
        nxt = model(ids).logits[:, -1].argmax(-1)  # nxt: [2048]
    hits = (nxt == model.config.eos_token_id).nonzero().flatten()
    assert len(hits) > 0, "no prompt leads to EOS; enlarge the search"
    prompt = ids[hits[0]].tolist()
    out = peft_oracle(tiny_model_dir, None, prompt, 10)
    assert out[0] == model.config.eos_token_id and len(out) == 10
    assert out == _greedy_by_hand(model, prompt, 10)


def test_bad_arguments_are_refused_with_reasons(tmp_path):
    with pytest.raises(DemoConfigError, match="arch"):
        make_base_model(tmp_path / "m", "gpt2")
    with pytest.raises(DemoConfigError, match="num_heads"):
        make_base_model(tmp_path / "m", hidden_size=60, num_heads=8)
    with pytest.raises(DemoConfigError, match="target_modules"):
        AdapterSpec(r=4, lora_alpha=8, target_modules=("embed_tokens",))
    with pytest.raises(DemoConfigError, match="positive"):
        AdapterSpec(r=0, lora_alpha=8)
