"""--engine-restart's crash-loop limit: max_restarts within a sliding window, then no more."""
from __future__ import annotations

import pytest

from server.engine.protocol.remote import RestartPolicy

pytestmark = pytest.mark.unit


def test_restarts_are_allowed_up_to_the_limit_within_the_window():
    policy = RestartPolicy(max_restarts=2, window_s=60.0)
    assert policy.allow(0.0) and policy.allow(10.0)
    assert not policy.allow(20.0)  # a third death within 60 s: a crash loop
    assert policy.allow(61.0)  # the first restart left the window
    assert not policy.allow(65.0)
    assert policy.describe() == "2 restarts within 60 s"
