"""Loading a model directory's tokenizer without transformers' auto machinery where the directory allows it.

`AutoTokenizer.from_pretrained` first builds the model's config (AutoConfig, through the registry of
every model type) only to learn which tokenizer class to build: ~20 s of a 2-core machine's start-up
under load, 4x what building the tokenizer takes. When the directory holds a `tokenizer.json` and its
`tokenizer_config.json` names the generic fast class (`PreTrainedTokenizerFast`, which transformers 5
calls `TokenizersBackend`), AutoTokenizer ends in that same class for llama and mistral (for qwen2 it
builds Qwen2Tokenizer instead), so for those it is built directly.
Anything else (no `tokenizer.json`, a model-specific class, a remote-code `auto_map`, another model
type) goes through AutoTokenizer as before. Importing AutoTokenizer's module alone costs ~3 s.

Also here: GPT-2's byte-level alphabet (bytes_to_unicode), read by the engine's detokenizer and the
front end's token text.
"""
from __future__ import annotations

import json
from pathlib import Path

# The names transformers gives its generic tokenizers.json-backed class (`PreTrainedTokenizerFast` is an
# alias of `TokenizersBackend` in transformers 5).
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# The model types whose declared generic class AutoTokenizer keeps (tests/server/engine/test_tokenizer_loader.py checks
# each against AutoTokenizer).
DIRECT_MODEL_TYPES = frozenset({"llama", "mistral"})
# Local JSON files of a model directory, read before any tokenizer exists: bounded all the same.
MAX_CONFIG_BYTES = 4 << 20


def _json_file(path: Path) -> dict:
    """The JSON object in `path`, or {} when it is absent, too large or not an object."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def direct_fast_tokenizer(model_dir: str | Path) -> bool:
    """Whether AutoTokenizer would build the generic fast class for `model_dir`, so it can be built directly."""
    root = Path(model_dir)
    if not (root / "tokenizer.json").is_file():
        return False
    tok_config = _json_file(root / "tokenizer_config.json")
    if tok_config.get("tokenizer_class") not in GENERIC_FAST_CLASSES or "auto_map" in tok_config:
        return False
    return _json_file(root / "config.json").get("model_type") in DIRECT_MODEL_TYPES


def load_tokenizer(model_dir: str | Path):
    """The tokenizer AutoTokenizer.from_pretrained(model_dir) gives, built without it where it can be."""
    if direct_fast_tokenizer(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))
