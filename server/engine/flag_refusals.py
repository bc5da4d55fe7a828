"""The flag combinations the engine does not build, each refused in one line naming the flags.

One function for both places that check them: the engine before it loads the weights (the Python API,
and the core a server starts) and `loraplex serve` before it starts the core, so a refusal there is one
line on stderr rather than an engine core's traceback, its restarts and the lifespan's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from server.engine.config import GPTQ_QUANTIZATIONS, ModelConfig
from server.engine.gptq_checkpoint import checkpoint_quantization
from server.engine.parallel.tp_model import tp_refusal
from server.engine.speculative_config import parse_speculative_config
from server.engine.unified_memory import unified_refusal


class EngineFlags(Protocol):
    """What the refusals read: EngineConfig and the server's ServerConfig both have these."""
    tensor_parallel_size: int
    fully_sharded_loras: bool
    lora_page_rows: int | None
    max_lora_rank: int
    unified_memory: bool
    quantization: str | None
    int4_group_size: int | None
    speculative_config: object  # its JSON text, a dict, a SpeculativeConfig, or None


def combination_refusal(flags: EngineFlags, mcfg: ModelConfig, draft_model: bool, model_dir: str | Path) -> str | None:
    """The one line `flags` are refused with for this model (`draft_model`: --speculative-config names
    one; `model_dir`: its checkpoint, whose GPTQ groups a sharded int4 base keeps), or None: they run."""
    n = flags.tensor_parallel_size
    if n > 1:
        if flags.lora_page_rows is not None and flags.fully_sharded_loras:  # A's rank rows cut by rank, not by page
            return "--fully-sharded-loras does not combine with --lora-page-rows yet"
        spec = parse_speculative_config(flags.speculative_config)
        if spec is not None and spec.method != "ngram":  # ngram drafts on rank 0; its verify is a plain step
            return (f"--tensor-parallel-size {n} does not combine with --speculative-config method {spec.method} "
                    f"yet (ngram does)")
        quantization = "int4" if flags.quantization in GPTQ_QUANTIZATIONS else flags.quantization
        groups = _int4_group_size(flags, model_dir) if quantization == "int4" else None
        refusal = tp_refusal(mcfg, quantization, n, flags.fully_sharded_loras, flags.max_lora_rank, groups)
        if refusal is not None:
            return refusal
    if flags.unified_memory:
        return unified_refusal(n, draft_model, mcfg.kv_groups is not None)
    return None


def _int4_group_size(flags: EngineFlags, model_dir: str | Path) -> int | None:
    """An int4 base's groups: --int4-group-size, else a GPTQ checkpoint's (-1: a whole row), else None
    (the default of quantizing at load)."""
    if flags.int4_group_size is not None:
        return flags.int4_group_size
    spec = checkpoint_quantization(json.loads((Path(model_dir) / "config.json").read_text()))
    return None if spec is None else spec.group_size
