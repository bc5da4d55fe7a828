"""The built-in demo model: a tiny Llama-family model and PEFT adapters, made
deterministically on first run so loraplex serves something with no model hub.

Everything here is random-weight but *decisive*: weights are scaled so that
greedy decoding has clear winners (top-1 vs top-2 logit gaps well above
float noise), which is what lets engine tests compare token-for-token with
transformers + PEFT. Same inputs give byte-identical files on every run.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from server.atomic_dir import build_atomically, is_complete

CORPUS_PATH = Path(__file__).parent / "assets" / "demo_corpus.txt"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's Linear modules, which PEFT targets as they are: q/k/v and gate/up fused.
PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# Roles render as plain-text markers; each turn ends in EOS so a trained model
# would learn to stop there. Content may be a string or OpenAI-style parts.
# Tools render Hermes-style (a <tools> system turn; an assistant's calls as
# <tool_call>{"name", "arguments"}</tool_call>; results as `tool` turns), so the
# demo model serves tool calling with `--tool-call-parser hermes`; a chat
# without tools renders as it always has.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\nCall a function as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>' + eos_token + '\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


class DemoConfigError(ValueError):
    """A demo model or adapter was asked for with arguments that cannot work."""


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter to generate; fields follow peft.LoraConfig."""

    r: int
    lora_alpha: int
    target_modules: tuple[str, ...] = SEVEN
    use_rslora: bool = False
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, int] | None = None
    seed: int = 1
    use_dora: bool = False

    def __post_init__(self) -> None:
        if self.r <= 0 or self.lora_alpha <= 0:
            raise DemoConfigError(f"r and lora_alpha must be positive, got r={self.r} alpha={self.lora_alpha}")
        unknown = set(self.target_modules) - set(SEVEN) - set(PHI3_MODULES)
        if not self.target_modules or unknown:
            raise DemoConfigError(f"target_modules must be a non-empty subset of {SEVEN}, got {self.target_modules}")
        for name, pattern in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            if pattern and any(v <= 0 for v in pattern.values()):
                raise DemoConfigError(f"{name} values must be positive, got {pattern}")


@dataclass(frozen=True)
class DemoPaths:
    model_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)


DEMO_MODEL = MappingProxyType(dict(arch="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                   intermediate_size=256, max_position_embeddings=2048))
DEMO_VOCAB = 512
DEMO_ADAPTERS: MappingProxyType[str, AdapterSpec] = MappingProxyType({
    "demo-r4": AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=11),
    "demo-r8": AdapterSpec(r=8, lora_alpha=16, seed=12),
    "demo-r16-rslora": AdapterSpec(r=16, lora_alpha=16, use_rslora=True, seed=13),
    "demo-r64": AdapterSpec(r=64, lora_alpha=128, seed=14),
    "demo-pattern": AdapterSpec(r=8, lora_alpha=16, rank_pattern={"o_proj": 4, "down_proj": 16},
                                alpha_pattern={"q_proj": 32}, seed=15),
})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEMO_VOCAB, *, model_max_length: int = 2048) -> int:
    """Train a byte-level BPE on the shipped corpus and write HF tokenizer files.

    Returns the vocabulary size actually written (== vocab_size for the corpus shipped).
    Encoding adds BOS, like Llama tokenizers; the chat template writes its own BOS and
    transformers tokenizes templates without special tokens, so it is never doubled.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 259 + 1:
        raise DemoConfigError(f"vocab_size must exceed 256 bytes + 3 special tokens, got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    return tok.get_vocab_size()


def _config(arch: str, **kw):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "phi3": transformers.Phi3Config,
           "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[arch]
    if arch in ("mistral", "phi3"):
        kw.setdefault("sliding_window", None)  # unless asked for: a window wider than max length confuses
    if arch in ("qwen3", "gemma2", "gemma3"):  # their defaults are the 8B-class 128/256
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    rope_scaling = kw.pop("rope_scaling")
    if rope_scaling is not None:
        # transformers 5 folds rope_theta and the scaling dict into rope_parameters.
        kw["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    return cls(**kw)


@torch.no_grad()
def _decisive_init(model: torch.nn.Module, hidden_size: int, seed: int) -> None:
    """Re-initialise every weight from one seeded generator, in name order.

    HF's std-0.02 init makes near-uniform logits where argmax is decided by
    float noise. Here projections use std 1/sqrt(fan_in) (unit-scale outputs),
    embeddings std 1, lm_head std 2/sqrt(hidden) so logits have std ~2 after
    the final RMSNorm, norms 1, biases std 0.1. Tied models differ (see below)
    but keep logits at std ~2 too.
    """
    gen = torch.Generator().manual_seed(seed)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            std = None
        elif "embed_tokens" in name:
            # Tied, the embedding is also the output head, and the residual copy
            # of the input token would win every argmax (echo loops). A small
            # embedding keeps that self-term minor; the final norm's gain
            # restores the logit scale.
            std = 0.5 / math.sqrt(hidden_size) if tied else 1.0
        elif name.startswith("lm_head"):
            std = 2.0 / math.sqrt(hidden_size)
        elif name.endswith(".bias"):
            std = 0.1
        elif p.dim() == 2:
            std = 1.0 / math.sqrt(p.shape[1])
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}")
        if std is None:
            p.fill_(4.0 if tied and name == "model.norm.weight" else 1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def make_base_model(out_dir: str | os.PathLike, arch: str = "llama", *, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, max_position_embeddings: int = 1024,
                    tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                    attention_bias: bool | None = None, vocab_size: int = DEMO_VOCAB,
                    seed: int = 0, dtype: torch.dtype = torch.float32,
                    config_overrides: dict | None = None) -> Path:
    """Write a random-weight HF model directory (config, safetensors, tokenizer).

    attention_bias: None means what the arch implies (qwen2: q/k/v biases,
    the others: none); True is accepted for llama only. config_overrides: more
    config fields (a Gemma's window, soft-caps, layer_types).
    """
    import transformers

    if arch not in ARCHS:
        raise DemoConfigError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise DemoConfigError(
            f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}), "
            f"which must divide by num_kv_heads ({num_kv_heads})")
    if attention_bias is not None and attention_bias != (arch == "qwen2") and arch != "llama":
        raise DemoConfigError(f"{arch} fixes attention_bias to {arch == 'qwen2'}")
    out = Path(out_dir)
    n_vocab = make_tokenizer(out, vocab_size, model_max_length=max_position_embeddings)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    kw = dict(vocab_size=n_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
              num_hidden_layers=num_layers, num_attention_heads=num_heads,
              num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
              tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling,
              bos_token_id=tok.convert_tokens_to_ids(BOS), eos_token_id=tok.convert_tokens_to_ids(EOS),
              pad_token_id=tok.convert_tokens_to_ids(PAD))
    if arch == "llama":
        kw["attention_bias"] = bool(attention_bias)
    config = _config(arch, **kw, **(config_overrides or {}))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _decisive_init(model, hidden_size, seed)
    model.to(dtype).save_pretrained(out)
    return out


@torch.no_grad()
def _decisive_lora_init(model: torch.nn.Module, seed: int, rel_scale: float = 0.5) -> None:
    """Draw LoRA A/B so each module's delta is ~rel_scale of its base output.

    A ~ N(0, 1/in) keeps A x at the input's scale; B's std divides out sqrt(r)
    and the module's PEFT scaling, so rank, alpha, rslora and the patterns all
    give a visible but not overwhelming change.
    """
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    layers = sorted(((n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)), key=lambda kv: kv[0])
    assert layers, "no LoRA layers were injected"
    for _, m in layers:
        a = m.lora_A["default"].weight  # a: [r, in]
        b = m.lora_B["default"].weight  # b: [out, r]
        r, scaling = m.r["default"], m.scaling["default"]
        a.copy_(torch.randn(a.shape, generator=gen) / math.sqrt(a.shape[1]))
        b.copy_(torch.randn(b.shape, generator=gen) * (rel_scale / (math.sqrt(r) * scaling)))
        if "default" in m.lora_magnitude_vector:
            # DoRA: PEFT set m to ||W + s B A|| of the A and B it drew; move each row's length off
            # that by up to +-40% so the magnitude vector changes the output visibly too.
            magnitude = m.lora_magnitude_vector["default"].weight  # [out]
            magnitude.mul_(0.6 + 0.8 * torch.rand(magnitude.shape, generator=gen))


def make_adapter(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, r: int = 8, lora_alpha: int = 16,
                 target_modules: tuple[str, ...] = SEVEN, use_rslora: bool = False,
                 rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, int] | None = None,
                 seed: int = 1, use_dora: bool = False) -> Path:
    """Write a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors); a DoRA one
    (lora_magnitude_vector per module too) with use_dora."""
    import transformers
    from peft import LoraConfig, get_peft_model

    spec = AdapterSpec(r=r, lora_alpha=lora_alpha, target_modules=tuple(target_modules), use_rslora=use_rslora,
                       rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, seed=seed, use_dora=use_dora)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, target_modules=list(spec.target_modules),
                        use_rslora=spec.use_rslora, rank_pattern=dict(spec.rank_pattern or {}),
                        alpha_pattern=dict(spec.alpha_pattern or {}), init_lora_weights=False,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", use_dora=spec.use_dora)
    # PEFT draws its own A and B from the global RNG, and a DoRA magnitude vector is ||W + s B A|| of
    # those: seeded here (and the caller's RNG left as it was), so the adapter is the seed's alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = get_peft_model(base, config)
    _decisive_lora_init(model, spec.seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    # PEFT writes target_modules in set order (varies with the hash seed) and a
    # model card; normalise so the directory is byte-identical on every run.
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["target_modules"] = [m for m in dict.fromkeys(SEVEN + PHI3_MODULES) if m in spec.target_modules]
    _write_json(cfg_path, cfg)
    (out / "README.md").unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def _quiet_builds() -> Iterator[None]:
    """Without transformers' per-file progress bars ("Loading weights", "Writing model shards": six of them for
    the demo) and the FutureWarning that peft's read of a deprecated transformers property raises (their code,
    not ours); the caller says one line per build instead. Both are restored after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def ensure_demo(root: str | os.PathLike, say: Callable[[str], None] | None = None) -> DemoPaths:
    """Make (once) the demo model under root/model and its adapters under root/adapters/<name>;
    `say` gets one line per build."""
    say = say or (lambda line: None)
    root = Path(root).resolve()
    model_dir = root / "model"
    model_files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    adapter_files = ("adapter_config.json", "adapter_model.safetensors")
    adapters = {}
    with _quiet_builds():
        if not is_complete(model_dir, model_files):
            say(f"building the demo model (random weights, once) in {model_dir}")
            build_atomically(model_dir, model_files, lambda d: make_base_model(d, vocab_size=DEMO_VOCAB,
                                                                               **DEMO_MODEL))
        for name, spec in DEMO_ADAPTERS.items():
            adir = root / "adapters" / name
            if not is_complete(adir, adapter_files):
                say(f"building demo adapter {name} (once)")
                build_atomically(adir, adapter_files, lambda d, s=spec: make_adapter(
                    model_dir, d, r=s.r, lora_alpha=s.lora_alpha, target_modules=s.target_modules,
                    use_rslora=s.use_rslora, rank_pattern=s.rank_pattern, alpha_pattern=s.alpha_pattern,
                    seed=s.seed))
            adapters[name] = adir
    return DemoPaths(model_dir=model_dir, adapters=adapters)
