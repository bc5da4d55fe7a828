"""The data-parallel router's tiers: resident, free slot, waiting, least loaded; a full core spills;
round-robin skips dead cores; none healthy is EngineDeadError."""
from __future__ import annotations

import pytest

from server.engine.data_parallel.router import CoreView, Router
from server.engine.protocol.errors import EngineDeadError

pytestmark = pytest.mark.unit


def core(in_flight=0, device=(), waiting=(), healthy=True, max_loras=2, max_num_seqs=4) -> CoreView:
    return CoreView(healthy, in_flight, max_num_seqs, max_loras, frozenset(device), frozenset(waiting))


def test_the_adapters_core_wins_over_a_less_loaded_one():
    assert Router("affinity").choose("a", [core(0, {"x", "y"}), core(3, {"a"})]) == 1


def test_then_a_free_slot_then_where_it_waits_then_least_loaded():
    router = Router("affinity")
    assert router.choose("a", [core(0, {"x", "y"}), core(2, {"z"})]) == 1  # a free slot
    assert router.choose("a", [core(0, {"x", "y"}), core(2, {"z", "w"}, waiting={"a"})]) == 1
    assert router.choose("a", [core(2, {"x", "y"}), core(1, {"z", "w"})]) == 1
    assert router.choose(None, [core(2, {"a"}), core(1)]) == 1  # the base: least loaded


def test_a_full_core_spills_to_one_with_room():
    """A tenant kept on one core by affinity is not queued there while another has seats."""
    assert Router("affinity").choose("a", [core(4, {"a"}), core(1, {"x", "y"})]) == 1
    assert Router("affinity").choose("a", [core(5, {"a"}), core(4, {"x", "y"})]) == 0  # all full: affinity again


def test_dead_cores_are_skipped_and_none_left_is_an_error():
    assert Router("affinity").choose("a", [core(0, {"a"}, healthy=False), core(3)]) == 1
    router = Router("round-robin")
    cores = [core(), core(healthy=False), core()]
    assert [router.choose("a", cores) for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(EngineDeadError):
        router.choose("a", [core(healthy=False)])


def test_an_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="routing"):
        Router("random")
