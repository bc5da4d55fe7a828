"""TenantShare's bookkeeping: an equal split among the tenants asking, fair turns for waiters."""
from __future__ import annotations

import pytest
from server.tenant_share import TenantShare

pytestmark = pytest.mark.unit


def test_a_lone_tenant_takes_every_slot_and_a_newcomer_gets_the_next_free_one():
    share = TenantShare[str](2)
    assert share.ask("a", "a1") == ["a1"] and share.ask("a", "a2") == ["a2"]
    assert share.ask("a", "a3") == [] and share.ask("b", "b1") == []
    assert share.share() == 1
    assert share.release("a") == ["b1"]   # b holds none: its turn before a's third
    assert share.release("a") == ["a3"]


def test_waiters_take_turns_by_slots_held_then_arrival_and_most_bounds_a_tenant():
    share = TenantShare[str](3, most=1)
    assert share.ask("a", "a1") == ["a1"] and share.ask("a", "a2") == []
    assert share.ask("b", "b1") == ["b1"] and share.ask("c", "c1") == ["c1"]
    assert share.ask("c", "c2") == [] and share.ask("b", "b2") == []
    assert share.cancel("b2") and not share.cancel("b2")
    assert share.release("b") == []       # each of a and c holds its one already
    assert share.release("c") == ["c2"]   # a holds its most (1); c holds none now
    assert share.held == {"a": 1, "c": 1}


def test_the_waiter_holding_fewest_goes_first_then_the_one_that_waited_longest():
    share = TenantShare[str](4)
    for w in ("a1", "a2", "a3", "a4"):
        share.ask("a", w)
    for w in ("a5", "b1", "b2", "c1"):
        assert share.ask(w[0], w) == []
    assert share.release("a") == ["b1"]   # b and c hold none: b arrived first
    assert share.release("a") == ["c1"]
    assert share.release("a") == ["a5"]   # a, b and c hold one each: a5 waited longest
    assert share.release("c") == ["b2"]
