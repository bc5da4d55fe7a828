"""Slots sized from memory (issue 21, item 4): a pure function of the model's shape, rank, dtype and
a byte budget."""
from __future__ import annotations

import pytest
import torch

from benchmarks.aot.aot_shapes import MODELS
from server.engine.config import ModelConfig
from server.engine.lora.slot_budget import (
    CPU_DEFAULT_LORAS, MAX_AUTO_LORAS, SlotBudgetError, free_device_bytes, resolve_max_loras, slot_bytes,
    slots_for_memory)

pytestmark = pytest.mark.unit

LLAMA3_8B = ModelConfig.from_dict(MODELS["llama3-8b"])
WEIGHTS_8B = 16_060_522_496  # Llama-3-8B's bf16 weights


def test_one_rank_16_slot_is_the_adapter_bytes_plus_scales() -> None:
    per_slot = slot_bytes(LLAMA3_8B, 16, torch.bfloat16)
    # A and B on all seven projections (the 83.9 MB), a float32 DoRA scale per output column
    # (43,008 per layer) and 7 float32 scalings per layer.
    lora = 32 * 16 * 2 * (3 * 4096 + 4096 + 2 * 4096 + 14336 + (4096 + 1024 + 1024) + 4096 + 2 * 14336 + 4096)
    assert lora == 83_886_080
    assert per_slot == lora + 32 * 4 * (6144 + 4096 + 2 * 14336 + 4096) + 32 * 4 * 7
    assert slot_bytes(LLAMA3_8B, 64, torch.bfloat16) - 32 * 4 * (43_008 + 7) == 4 * lora
    assert slot_bytes(LLAMA3_8B, 16, torch.float32) - 32 * 4 * (43_008 + 7) == 2 * lora


def test_64_rank_16_slots_fit_an_80_gb_card_beside_the_kv_cache() -> None:
    free = 80 * 10**9 - WEIGHTS_8B - 2 * 2**30  # the weights loaded, a CUDA context and scratch
    slots = slots_for_memory(LLAMA3_8B, 16, torch.bfloat16, free)
    assert 64 <= slots < 80
    assert slots * slot_bytes(LLAMA3_8B, 16, torch.bfloat16) <= 0.10 * free  # the KV cache keeps 90%
    assert slots // 4 <= slots_for_memory(LLAMA3_8B, 64, torch.bfloat16, free) <= slots // 4 + 1  # ~a quarter
    assert slots_for_memory(LLAMA3_8B, 8, torch.bfloat16, 10**13) == MAX_AUTO_LORAS


def test_refused_when_not_even_one_slot_fits() -> None:
    per_slot = slot_bytes(LLAMA3_8B, 512, torch.bfloat16)
    assert slots_for_memory(LLAMA3_8B, 512, torch.bfloat16, 10 * per_slot) == 1
    with pytest.raises(SlotBudgetError, match="max_lora_rank 512 takes .* MiB, over the .* MiB budget"):
        slots_for_memory(LLAMA3_8B, 512, torch.bfloat16, 10 * per_slot - 10)
    with pytest.raises(SlotBudgetError):
        slots_for_memory(LLAMA3_8B, 16, torch.bfloat16, 0)


def test_resolution_keeps_a_given_count_and_the_cpu_default() -> None:
    assert resolve_max_loras(3, LLAMA3_8B, 16, torch.bfloat16, 10**9)[0] == 3  # asked for: taken as is
    assert resolve_max_loras(None, LLAMA3_8B, 16, torch.bfloat16, None)[0] == CPU_DEFAULT_LORAS == 8
    slots, why = resolve_max_loras(None, LLAMA3_8B, 16, torch.bfloat16, 70 * 2**30)
    assert slots == slots_for_memory(LLAMA3_8B, 16, torch.bfloat16, 70 * 2**30) >= 64
    assert f"{slots} adapter slots at max_lora_rank 16" in why and "70.00 GiB free" in why


def test_free_memory_is_measured_on_cuda_only(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (events.append(f"mem_get_info({d})"), (7, 9))[1])
    assert free_device_bytes(torch.device("cpu")) is None and events == []
    assert free_device_bytes(torch.device("cuda", 1)) == 7
    assert events == ["empty_cache", "mem_get_info(cuda:1)"]  # cached blocks returned before measuring


def test_an_engine_on_the_cpu_keeps_8_slots_when_unset(tiny_model_dir) -> None:
    from server.engine import LLM

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_blocks=16, max_model_len=64)
    assert llm.engine.config.lora.max_loras is None and llm.engine.max_loras == llm.engine.lora_slots.max_loras == 8


def test_max_loras_auto_on_the_command_line(tmp_path) -> None:
    from server.cli import build_parser
    from server.config import ServerConfig

    parser = build_parser()
    base = ["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16]
    def max_loras(*flags: str) -> int | None:
        return ServerConfig.from_args(parser.parse_args([*base, *flags]), env={}).engine.lora.max_loras

    assert max_loras() == 8  # the default is unchanged
    assert max_loras("--max-loras", "auto") is None
    assert max_loras("--max-loras", "12") == 12
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--max-loras", "0"])
