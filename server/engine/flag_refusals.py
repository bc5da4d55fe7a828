"""The flag combinations the engine does not build, each refused in one line naming the flags.

One function for both places that check them: the engine before it loads the weights (the Python API,
and the core a server starts) and `loraplex serve` before it starts the core, so a refusal there is one
line on stderr rather than an engine core's traceback, its restarts and the lifespan's.
"""
from __future__ import annotations

import json
from pathlib import Path

from server.engine.config import EngineConfig, ModelConfig
from server.engine.gptq_checkpoint import checkpoint_quantization
from server.engine.parallel.tp_model import tp_refusal
from server.engine.unified_memory import unified_refusal


def combination_refusal(config: EngineConfig, mcfg: ModelConfig, draft_model: bool,
                        model_dir: str | Path) -> str | None:
    """The one line `config` is refused with for this model (`draft_model`: --speculative-config names
    one; `model_dir`: its checkpoint, whose GPTQ groups a sharded int4 base keeps), or None: it runs."""
    n, lora = config.parallel.tensor_parallel_size, config.lora
    if n > 1:
        if lora.lora_page_rows is not None and config.parallel.fully_sharded_loras:  # A's rank rows cut by rank
            return "--fully-sharded-loras does not combine with --lora-page-rows yet"
        spec = config.speculative_config
        if spec is not None and spec.method != "ngram":  # ngram drafts on rank 0; its verify is a plain step
            return (f"--tensor-parallel-size {n} does not combine with --speculative-config method {spec.method} "
                    f"yet (ngram does)")
        quantization = config.quantization.quantization  # gptq's names already read as int4
        groups = _int4_group_size(config, model_dir) if quantization == "int4" else None
        refusal = tp_refusal(mcfg, quantization, n, config.parallel.fully_sharded_loras, lora.max_lora_rank, groups)
        if refusal is not None:
            return refusal
    if lora.unified_memory:
        return unified_refusal(n, draft_model, mcfg.kv_groups is not None)
    return None


def _int4_group_size(config: EngineConfig, model_dir: str | Path) -> int | None:
    """An int4 base's groups: --int4-group-size, else a GPTQ checkpoint's (-1: a whole row), else None
    (the default of quantizing at load)."""
    if config.quantization.int4_group_size is not None:
        return config.quantization.int4_group_size
    spec = checkpoint_quantization(json.loads((Path(model_dir) / "config.json").read_text()))
    return None if spec is None else spec.group_size
