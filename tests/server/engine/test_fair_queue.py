"""FairQueue: virtual token counters (VTC) per tenant, lowest backlogged counter first, no banking of credit."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.scheduler import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST, FairQueue
from tests.server.engine.sequences import request

pytestmark = pytest.mark.unit


class Arrivals:
    """Requests of a given prompt length, numbered in arrival order as the engine numbers them."""

    def __init__(self) -> None:
        self.count = itertools.count()

    def __call__(self, tenant: str | None, tokens: int = 10, priority: int = 0):
        return request([1] * tokens, next(self.count), tenant=tenant, priority=priority)


def _tenants(queue: FairQueue) -> list:
    return [seq.tenant for seq in queue.ordered()]


def _run(queue: FairQueue, *seqs) -> None:
    """Queue `seqs` together, then admit them: none of them returns from idle after another started."""
    for seq in seqs:
        queue.push(seq)
    for seq in seqs:
        queue.admitted(seq)


def test_within_a_tenant_lower_priority_value_first_then_arrival():
    new, q = Arrivals(), FairQueue()
    late_urgent = new("a", priority=-1)
    seqs = [new("a", priority=p) for p in (0, 1, 0)]
    q.push(seqs[1])
    q.push(seqs[0])
    q.push(seqs[2])
    q.push(late_urgent)
    assert list(q.ordered()) == [late_urgent, seqs[0], seqs[2], seqs[1]]


def test_equal_tenants_alternate_and_ties_go_by_tenant_name():
    new, q = Arrivals(), FairQueue()
    for _ in range(3):
        q.push(new("b"))
    for _ in range(3):
        q.push(new("a"))
    assert _tenants(q) == ["a", "b"] * 3


def test_counters_charge_prompt_and_output_tokens_divided_by_the_weight():
    new, q = Arrivals(), FairQueue()
    q.set_weight("a", 2.0)
    seq = new("a", tokens=10)
    q.push(seq)
    q.admitted(seq)
    assert seq not in q and not q
    assert q.counters["a"] == 10 * PROMPT_TOKEN_COST / 2.0
    q.charge_output(seq, 3)
    assert q.counters["a"] == (10 * PROMPT_TOKEN_COST + 3 * OUTPUT_TOKEN_COST) / 2.0


def test_only_the_uncached_part_of_a_prompt_is_charged():
    new, q = Arrivals(), FairQueue()
    seq = new("a", tokens=20)
    q.push(seq)
    seq.num_computed_tokens = 16  # a prefix-cache hit
    q.admitted(seq)
    assert q.counters["a"] == 4 * PROMPT_TOKEN_COST


def test_output_tokens_cost_more_than_prompt_tokens():
    new, q = Arrivals(), FairQueue()
    decoder = new("a", tokens=1)
    _run(q, decoder, new("b", tokens=15))
    q.charge_output(decoder, 8)  # 1 + 16 against 15
    q.push(new("a"))
    q.push(new("b"))
    assert _tenants(q) == ["b", "a"]


def test_the_lowest_backlogged_counter_goes_first_whoever_is_lower_but_idle():
    new, q = Arrivals(), FairQueue()
    q.charge("idle", 1.0)
    _run(q, new("a", 30), new("b", 20))
    q.push(new("a"))
    q.push(new("b"))
    assert _tenants(q) == ["b", "a"]


def test_a_weight_of_two_gets_twice_the_admissions():
    new, q = Arrivals(), FairQueue()
    q.set_weight("heavy", 2.0)
    for _ in range(8):
        q.push(new("heavy"))
        q.push(new("light"))
    first = _tenants(q)[:9]
    assert first.count("heavy") == 6 and first.count("light") == 3


def test_a_tenant_returning_from_idle_is_lifted_to_the_lowest_active_counter():
    new, q = Arrivals(), FairQueue()
    a = new("a", tokens=30)
    _run(q, a, new("b", tokens=50))
    q.charge("idle", 5.0)  # what it ran long ago
    q.push(new("idle"))
    assert q.counters["idle"] == 30.0  # banked nothing while away
    q.stopped_running(a)
    q.charge("rich", 90.0)
    q.push(new("rich"))
    assert q.counters["rich"] == 90.0  # lifted, never lowered


def test_a_tenant_still_running_is_not_lifted_when_it_queues_again():
    new, q = Arrivals(), FairQueue()
    mine = new("a", tokens=5)
    _run(q, mine, new("b", tokens=50))
    q.push(new("a"))
    assert q.counters["a"] == 5.0


def test_a_tenant_whose_requests_all_finished_is_idle_again():
    new, q = Arrivals(), FairQueue()
    mine = new("a", tokens=5)
    _run(q, mine, new("b", tokens=50))
    q.stopped_running(mine)
    q.push(new("a"))
    assert q.counters["a"] == 50.0


def test_remove_len_contains_and_the_base_tenant():
    new, q = Arrivals(), FairQueue()
    a, b, none = new("a"), new("b"), new(None)
    for seq in (a, b, none):
        q.push(seq)
    assert len(q) == 3 and none in q and a in q
    q.remove(b)
    assert len(q) == 2 and b not in q and _tenants(q) == [None, "a"]  # str(None) sorts before "a"
    q.remove(a)
    q.remove(none)
    assert not q and len(q) == 0 and list(q.ordered()) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", None]), st.integers(1, 40)), min_size=1, max_size=24),
       st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 3.0])))
def test_ordered_is_the_order_admitting_one_at_a_time_gives(requests, weights):
    new, q = Arrivals(), FairQueue()
    for tenant, weight in weights.items():
        q.set_weight(tenant, weight)
    for tenant, tokens in requests:
        q.push(new(tenant, tokens))
    planned = list(q.ordered())
    admitted = []
    while q:
        seq = next(q.ordered())
        q.admitted(seq)
        admitted.append(seq)
    assert admitted == planned and len(planned) == len(requests)


def test_shares_split_a_step_by_weight_and_pass_on_what_a_tenant_needs_less_of():
    queue = FairQueue()
    queue.set_weight("heavy", 2.0)
    assert queue.shares({"a": 100.0, "heavy": 100.0, "b": 100.0}, 40) == {"a": 10.0, "b": 10.0, "heavy": 20.0}
    shares = queue.shares({"a": 100.0, "heavy": 100.0, "small": 4.0}, 40)
    assert shares["small"] == 4.0 and shares["heavy"] == 2 * shares["a"] == 24.0
    assert queue.shares({"a": 3.0}, 40) == {"a": 3.0}
