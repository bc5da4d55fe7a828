"""The runner reuses the previous step's LoraBatch only while it would build the same one: the same token
slots, and the same ranks and DoRA flags in the slots they name."""
import pytest
import torch

from server.engine.model_runner import ModelRunner

pytestmark = pytest.mark.unit


def _runner(slot_ranks: list[int], slot_dora: list[bool]) -> ModelRunner:
    # Only what _lora_batch reads: a runner without a model.
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.slot_ranks, runner.slot_dora = slot_ranks, slot_dora
    runner.rank_table = runner.page_table = runner.page_gathers = None
    runner.last_lora = None
    return runner


def test_the_same_slots_reuse_the_batch():
    runner = _runner([8, 16, 4], [False, False, False])
    first = runner._lora_batch([0, 0, -1, 1])
    assert runner._lora_batch([0, 0, -1, 1]) is first
    other = runner._lora_batch([0, -1, 1, 1])
    assert other is not first and other.runs_host == ((0, 1, 2), (1, 1, 2), (0, -1, 1))


def test_a_changed_rank_or_dora_flag_of_an_active_slot_rebuilds():
    ranks, dora = [8, 16, 4], [False, False, False]
    runner = _runner(ranks, dora)
    first = runner._lora_batch([0, 1])
    ranks[2] = 32  # not in the step: still the same batch
    assert runner._lora_batch([0, 1]) is first
    ranks[1] = 32
    second = runner._lora_batch([0, 1])
    assert second is not first and second.rank_bound == 32
    dora[0] = True
    third = runner._lora_batch([0, 1])
    assert third is not second and third.dora
