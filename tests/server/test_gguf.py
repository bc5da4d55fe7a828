"""GGUF models: a small GGUF written here with the `gguf` package's writer (llama.cpp's layout: q/k rows
permuted, 2-D weights quantised), converted by loraplex, and checked against transformers' own GGUF
loader: the same logits, and loraplex's greedy tokens and logprobs equal to transformers'."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from server.config import ConfigError, ServerConfig
from server.engine import LLM, SamplingParams
from server.gguf_convert import ensure_converted
from server.gguf_reader import GGUFError, GGUFFile
from tests.engine_helpers import random_prompts

pytestmark = pytest.mark.unit

gguf = pytest.importorskip("gguf")

TOL = 1e-4
VOCAB = 512


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf rotary permute of q/k rows (what the converter undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's names beyond the llama ones (convert_hf_to_gguf's tensor map), per architecture.
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
ARCH_LAYER = {"qwen3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
              "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
              "gemma2": _GEMMA_LAYER,
              "gemma3": {**_GEMMA_LAYER, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}}


def _arch_metadata(w, arch: str, cfg: dict) -> None:
    """What convert_hf_to_gguf writes for these architectures beyond a llama's."""
    if arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "phi3":
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(field) is not None:
                w.add_float32(f"{arch}.{field}", cfg[field])
    if arch == "gemma3":
        w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])


def write_gguf(model_dir: Path, out: Path, arch: str, quantize: bool = True) -> Path:
    """The HF model at model_dir as a GGUF file: 2-D weights in Q8_0 (F32 without `quantize`), norms and
    biases in F32; Gemma's norm gains as 1 + w, as llama.cpp writes them."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    _arch_metadata(w, arch, cfg)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             **ARCH_LAYER.get(arch, {})}
    for name, t in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{layer[module]}.{kind}"
        a = t.float().numpy()
        if arch == "llama" and ".attn_q." in gname:
            a = _permute(a, heads)
        elif arch == "llama" and ".attn_k." in gname:
            a = _permute(a, kv_heads)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if a.ndim == 2 and quantize:
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_model(request, tmp_path_factory, model_variant_dir):
    """(arch, gguf file, converted dir)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = write_gguf(model_variant_dir(arch), root / f"tiny-{arch}.Q8_0.gguf", arch)
    return arch, path, ensure_converted(path, root / "models", lambda line: None)


@torch.inference_mode()
def _hf_logits(model_dir: Path, ids: list[int], gguf_file: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    return model(input_ids=torch.tensor([ids])).logits[0]  # [L, V]


def test_converted_model_has_the_logits_transformers_reads_from_the_gguf(gguf_model):
    arch, path, converted = gguf_model
    ids = random_prompts(1, (24, 24), VOCAB, seed=5)[0]
    theirs = _hf_logits(path.parent, ids, gguf_file=path.name)
    ours = _hf_logits(converted, ids)
    assert torch.equal(theirs, ours)
    assert json.loads((converted / "config.json").read_text())["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]


def test_loraplex_serves_the_gguf_as_transformers_reads_it(gguf_model):
    _, path, converted = gguf_model
    prompts = random_prompts(3, (6, 20), VOCAB, seed=9)
    llm = LLM(converted, device="cpu", dtype="float32", kv_cache_blocks=32, max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        ref = torch.log_softmax(_hf_logits(path.parent, prompt + out.token_ids, gguf_file=path.name), -1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert token == int(row.argmax())
            assert abs(entry.logprob - float(row[token])) <= TOL


def test_tokenizer_and_chat_template_come_from_the_file(gguf_model, model_variant_dir):
    from transformers import AutoTokenizer

    arch, path, converted = gguf_model
    ours, original = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(model_variant_dir(arch))
    text = "The quick brown fox, café"
    # the original adds BOS through its post-processor, which a GGUF does not describe
    assert ours(text, add_special_tokens=False).input_ids == original(text, add_special_tokens=False).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_conversion_is_cached_by_content(tmp_path, model_variant_dir):
    src = write_gguf(model_variant_dir("llama"), tmp_path / "m.gguf", "llama")
    lines: list[str] = []
    first = ensure_converted(src, tmp_path / "models", lines.append)
    assert any(line.startswith("converting m.gguf") for line in lines) and "converted in" in lines[-1]
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    lines.clear()
    assert ensure_converted(src, tmp_path / "models", lines.append) == first and lines == []
    # the same bytes under another name and mtime: found by hash, not converted again
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(src.read_bytes())
    assert ensure_converted(copy, tmp_path / "models", lines.append) == first and lines == []
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    # edited in place with its mtime kept: the stat no longer matches the size, so it is hashed anew
    other = write_gguf(model_variant_dir("llama", tie=True), tmp_path / "tied.gguf", "llama")
    st = src.stat()
    src.write_bytes(other.read_bytes())
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = ensure_converted(src, tmp_path / "models", lines.append)
    assert second != first and json.loads((second / "config.json").read_text())["tie_word_embeddings"]


def test_bad_files_are_refused_with_reasons(tmp_path, gguf_model):
    _, path, _ = gguf_model
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(GGUFError, match="truncated|past the end"):
        GGUFFile(truncated)
    with pytest.raises(ConfigError, match="neither a Hugging Face model dir .* nor a GGUF file"):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, model=str(tmp_path / "cut.bin"))
    config = ServerConfig(data_dir=tmp_path, admin_token="x" * 16, model=str(path))
    assert config.model_id == path.name.removesuffix(".gguf")


def test_mixture_of_experts_gguf_is_refused_in_one_line(tmp_path):
    """llama.cpp writes Mixtral as a llama with an expert count (and ffn_*_exps tensors): refused by name."""
    from server.gguf_convert import hf_config

    path = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"mixture-of-experts GGUF \(8 experts\) is not supported"):
        hf_config(GGUFFile(path))
