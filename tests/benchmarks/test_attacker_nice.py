"""An attacker pool's initializer puts its processes at the nice level the bench asks for."""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from benchmarks.profile.cpu_pinning import pin_cpus

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("nice", [0, 7])
def test_attacker_processes_run_at_the_nice_level_asked(nice):
    own = os.nice(0)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=pin_cpus, initargs=(None, nice)) as pool:
        assert pool.submit(os.nice, 0).result() == min(19, own + nice)
