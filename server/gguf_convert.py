"""A GGUF file turned, once, into a Hugging Face model directory that the engine loads: config.json,
model.safetensors (dequantised to float32; the engine casts to the serving dtype on load), and the
tokenizer with its chat template.

Converted directories are cached under the data dir, one per file content: `<stem>-<sha256[:16]>`.
Keyed by content, an edited or replaced file is never served from a stale conversion, and two paths
to the same bytes share one. Hashing costs ~0.3 s per 100 MB, so each entry also records the path,
size and mtime it was last found for (`source.json`): a restart with that file unchanged finds its
entry without reading it (what make and pip trust), and only a changed stat costs a hash.

Weight names and layouts follow llama.cpp's convert_hf_to_gguf: llama's q/k rows are permuted for
its rotary layout, and are permuted back here (qwen2's are not). transformers' own GGUF loader is the
oracle in tests: the same file loaded by both gives the same logits.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np

from server.atomic_dir import build_atomically, is_complete
from server.gguf_archs import EXTRA_ARCHS, LAYER_NAMES, NORM_SHIFTED, arch_config
from server.gguf_reader import GGUFError, GGUFFile

CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "source.json")
# GGUF architecture -> (HF architecture, model_type, q/k rows permuted by llama.cpp)
ARCHS = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
         **{arch: (*names, False) for arch, names in EXTRA_ARCHS.items()}}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

Say = Callable[[str], None]


def hf_config(g: GGUFFile) -> dict:
    """config.json for the file's model, from llama.cpp's metadata keys."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{g.path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHS)})")
    hf_arch, model_type, _ = ARCHS[arch]
    if md.get(f"{arch}.expert_count"):  # llama.cpp writes Mixtral as a llama with ffn_*_exps tensors
        raise GGUFError(f"{g.path}: mixture-of-experts GGUF ({md[f'{arch}.expert_count']} experts) is not supported; "
                        "serve the Hugging Face directory instead")

    def key(name: str, default=None):
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{g.path}: metadata {arch}.{name} is missing")
        return value

    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if (scaling != "none" and arch != "gemma3") or "rope_freqs.weight" in g.tensors:  # gemma3: arch_config
        raise GGUFError(f"{g.path}: rope scaling ({scaling}) in a GGUF is not supported; serve the Hugging Face "
                        "directory instead")
    heads, hidden = key("attention.head_count"), key("embedding_length")
    config = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": g.tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(key("rope.freq_base", 10000.0)), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"), "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"), "dtype": "float32",
    }
    if arch in EXTRA_ARCHS:
        try:
            config |= arch_config(arch, key, md, config, g.tensors)
        except ValueError as e:
            raise GGUFError(f"{g.path}: {e}") from None
    return config


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permute of q/k rows: per head, its halves were interleaved pairwise."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer = _LAYER | LAYER_NAMES.get(arch, {})
    m = _BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in layer:
        raise GGUFError(f"GGUF tensor {name} has no Hugging Face counterpart that loraplex knows")
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def hf_tensors(g: GGUFFile, config: dict):
    """(HF name, float32 tensor) per GGUF tensor, one at a time (the caller keeps what it needs)."""
    import torch

    arch = g.metadata["general.architecture"]
    permuted = ARCHS[arch][2]
    for name in g.tensors:
        w = g.tensor(name)
        if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, config["num_attention_heads"])
        elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, config["num_key_value_heads"])
        elif arch in NORM_SHIFTED and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        yield hf_tensor_name(name, arch), torch.from_numpy(w)


def convert_gguf(path: Path, out: Path, say: Say) -> None:
    """Write the HF directory for the GGUF at `path` into `out` (an existing, empty directory)."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    started = time.monotonic()
    with GGUFFile(path) as g:
        config = hf_config(g)
        say(f"[1/3] read {len(g.metadata)} metadata keys and {len(g.tensors)} tensor headers "
            f"({time.monotonic() - started:.1f} s); building the tokenizer and chat template")
        # transformers builds the tokenizer a GGUF describes (vocabulary, merges, special tokens, template).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.model_max_length = config["max_position_embeddings"]
        tokenizer.save_pretrained(out)
        say(f"[2/3] dequantising {len(g.tensors)} tensors to float32 ({time.monotonic() - started:.1f} s)")
        tensors = dict(hf_tensors(g, config))
    say(f"[3/3] writing model.safetensors ({time.monotonic() - started:.1f} s)")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _entry_name(path: Path, digest: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", path.name.removesuffix(".gguf"))[:80] or "model"
    return f"{stem}-{digest[:16]}"


def ensure_converted(gguf: str | Path, cache_root: Path, say: Say) -> Path:
    """The converted directory for this GGUF under cache_root, made on first use (see the module doc)."""
    path = Path(gguf).resolve()
    source = _stat_key(path)
    entries = sorted(e for e in cache_root.iterdir() if is_complete(e, CONVERTED_FILES)) if cache_root.is_dir() else []
    for entry in entries:
        if _read_json(entry / "source.json").get("stat") == source:
            return entry
    digest = file_sha256(path)
    record = json.dumps({"sha256": digest, "stat": source}, indent=2, sort_keys=True) + "\n"
    for entry in entries:
        if _read_json(entry / "source.json").get("sha256") == digest:
            (entry / "source.json").write_text(record, encoding="utf-8")  # the same bytes, another path or mtime
            return entry
    dest = cache_root / _entry_name(path, digest)
    say(f"converting {path.name} ({source['size'] / 2**20:.0f} MiB) once into {dest}")
    started = time.monotonic()

    def build(tmp: Path) -> None:
        convert_gguf(path, tmp, say)
        (tmp / "source.json").write_text(record, encoding="utf-8")

    build_atomically(dest, CONVERTED_FILES, build)
    say(f"converted in {time.monotonic() - started:.1f} s")
    return dest


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
