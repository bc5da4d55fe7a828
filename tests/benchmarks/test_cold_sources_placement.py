"""bench_cold_sources' placements: `split` gives the server both cores and lets it put its engine core
alone on the victim's (issue 35's layout); `server-core` keeps the whole server, engine core included,
on the victim's core and moves only Redis and the loaders to the storm's."""
from __future__ import annotations

import pytest

from benchmarks.serving.bench_cold_sources import PLACEMENTS, placement_of

pytestmark = pytest.mark.unit


def test_split_gives_the_server_both_cores_and_its_engine_core_the_victims():
    split = placement_of("split", (0, 1))
    assert split.serve_flags == ("--engine-cpus", "0", "--api-cpus", "1")
    assert split.server_cores == (0, 1) and split.pin_children_to is None
    assert split.client_core == 1  # the victim's client runs with the storm's clients, off the engine's core


def test_server_core_keeps_the_server_on_the_victims_core():
    old = placement_of("server-core", (2, 5))
    assert old.serve_flags == () and old.server_cores == 2 and old.client_core == 2
    assert old.pin_children_to == 5


@pytest.mark.parametrize("name", PLACEMENTS)
def test_one_core_pins_nothing(name):
    assert placement_of(name, None) == placement_of("split", None)
    assert placement_of(name, None).serve_flags == ()
