"""Correctness on token ids: loraplex's greedy outputs against transformers + peft's, request by
request. Text is weak evidence (the first H100 run had 236 of 256 outputs empty after
detokenisation, so "same text" held for nothing); token ids are what both sides computed."""
from __future__ import annotations

from pathlib import Path

import torch

from server.bench.workload import BenchRequest


def compare_token_ids(requests: list[BenchRequest], ours: dict[int, list[int]],
                      theirs: dict[int, list[int]]) -> dict:
    """Per request: equal, or where the two first differ; missing outputs count as mismatches."""
    mismatches = []
    for r in requests:
        a, b = ours.get(r.index), theirs.get(r.index)
        if a is not None and a == b:
            continue
        first = None
        if a is not None and b is not None:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        mismatches.append({"index": r.index, "adapter": r.adapter_name, "first_mismatch": first,
                           "loraplex_tokens": None if a is None else len(a),
                           "peft_tokens": None if b is None else len(b)})
    return {"compared": len(requests), "same": len(requests) - len(mismatches), "mismatches": mismatches}


def peft_token_ids(model_dir: Path, named: dict[str, Path], requests: list[BenchRequest], *, device: str,
                   dtype: str, max_batch: int, threads: int) -> dict[int, list[int]]:
    """transformers + peft's greedy token ids for the requests (ignore_eos, as loraplex's)."""
    from server.bench.baseline import BaselineConfig, PeftBaseline

    used = {r.adapter_name for r in requests if r.adapter_name is not None}
    base = PeftBaseline(model_dir, {n: p for n, p in named.items() if n in used},
                        BaselineConfig(device, dtype, max_batch, threads=threads))
    base.run([BenchRequest(r.index, 0.0, r.adapter, r.tenant, r.prompt_ids, r.max_tokens) for r in requests])
    outputs = base.outputs
    del base
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return outputs
