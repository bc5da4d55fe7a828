"""The device tier paged by rank (server.engine.lora.slots with server.engine.lora.paging): an adapter
holds pages in proportion to its rank, anywhere in the pool; evicted pages are zeroed and its page-table
row names the zero page; adapters in use and pinned ones are never evicted; the rest go by idle time
per unit of reload cost."""
from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
import torch

from adapters.format import LoraAdapter, LoraWeights
from adapters.packed import pack_adapter
from kernels.lora_pages import dense_a, dense_b
from kernels.metadata import LoraBatch
from server.engine.lora.page_gathers import PageGathers
from server.engine.lora.paging import LoraPaging
from server.engine.lora.slots import LoraGroupBuffers, LoraSlots, PinLimitError

pytestmark = pytest.mark.unit

HIDDEN, MAX_RANK, ROWS = 8, 16, 4


def _slots(max_loras: int = 2, pins: int = 1) -> LoraSlots:
    """max_loras slots' worth of pages of ROWS rows over one layer's o projection."""
    paging = LoraPaging.of(max_loras, MAX_RANK, ROWS)
    layers = [{"o": LoraGroupBuffers.allocate(HIDDEN, (HIDDEN,), paging.entries, ROWS, torch.float32, "cpu",
                                              paging.pages, paging.dora_entries)}]
    return LoraSlots(layers, paging.entries, paging=paging, max_pins_per_tenant=pins)


def _adapter(rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = LoraWeights(torch.randn(rank, HIDDEN, generator=g) + 1, torch.randn(HIDDEN, rank, generator=g) + 1, 0.5)
    lora = LoraAdapter(rank, ("o_proj",), False, MappingProxyType({(0, "o_proj"): w}), 0, {})
    return pack_adapter(lora, torch.float32, pin=False)


def _resident_weights(slots: LoraSlots, version: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [R, in], B [out, R]) of `version` as the kernels see them through the page table."""
    buffers = slots.layers[0]["o"]
    batch = LoraBatch.build([0], page_table=slots.page_table)
    slot = slots.slot_of[version]
    return dense_a(buffers.a, batch)[0, slot], dense_b(buffers.b, batch)[0][slot]


def _check_pool(slots: LoraSlots) -> None:
    """Pages held are disjoint, every free page and the zero page are all zeros, and each resident
    adapter reads exactly its own weights with zeros past its rank."""
    buffers = slots.layers[0]["o"]
    held = [p for pages in slots.slot_pages.values() for p in pages]
    assert len(held) == len(set(held)) and 0 not in held
    assert sorted(held + slots.free_pages) == list(range(1, slots.paging.pages))
    for page in [0, *slots.free_pages]:
        assert buffers.a[0, page].abs().sum() == 0 and buffers.b[0][page].abs().sum() == 0


def test_an_adapter_holds_pages_by_its_rank_anywhere_in_the_pool():
    slots = _slots()  # 8 pages of 4 rows: two rank-16 slots' worth
    adapters = {f"r{r}": _adapter(r, r) for r in (4, 3, 16, 8)}
    for version, adapter in adapters.items():
        slots.acquire(version, adapter)
    assert {v: len(slots.slot_pages[slots.slot_of[v]]) for v in adapters} == {"r4": 1, "r3": 1, "r16": 4, "r8": 2}
    assert slots.stats().pages_used == 8 and not slots.free_pages  # four adapters where slots held two
    for version, adapter in adapters.items():
        a, b = _resident_weights(slots, version)
        r = adapter.rank
        assert torch.equal(a[:r], adapter.weights[0, "o_proj"].a) and a[r:].abs().sum() == 0
        assert torch.equal(b[:, :r], adapter.weights[0, "o_proj"].b) and b[:, r:].abs().sum() == 0
    _check_pool(slots)


def test_churn_reloads_into_scattered_pages_and_leaks_no_rows():
    """Evict adapters between others, then load a bigger one into the holes (not contiguous), and reload
    an evicted one into pages it never had."""
    slots = _slots()  # 8 pages, 4 entries
    adapters = {v: _adapter(r, i) for i, (v, r) in enumerate([("a", 4), ("b", 4), ("c", 8), ("d", 4)])}
    for v in adapters:
        slots.acquire(v, adapters[v])
    before = slots.slot_pages[slots.slot_of["c"]]
    for v in ("a", "c"):  # idle: holes between b and d
        slots.release(v)
    big = _adapter(16, 99)
    assert slots.can_acquire("big", big)
    slots.acquire("big", big)
    pages = slots.slot_pages[slots.slot_of["big"]]
    assert sorted(pages) != list(range(min(pages), min(pages) + 4))  # spread over the holes
    assert "a" not in slots.slot_of and "c" in slots.slot_of and slots.evictions == 1  # evicts only what it needs
    a, b = _resident_weights(slots, "big")
    assert torch.equal(a, big.weights[0, "o_proj"].a) and torch.equal(b, big.weights[0, "o_proj"].b)
    _check_pool(slots)
    slots.release("big")
    adapters["e"] = _adapter(8, 5)
    slots.acquire("e", adapters["e"])  # c's two pages (big's four cost more to bring back)
    assert "c" not in slots.slot_of and "big" in slots.slot_of
    slots.acquire("c", adapters["c"])
    assert set(slots.slot_pages[slots.slot_of["c"]]).isdisjoint(before)
    a, b = _resident_weights(slots, "c")
    assert torch.equal(a[:8], adapters["c"].weights[0, "o_proj"].a) and a[8:].abs().sum() == 0
    assert torch.equal(b[:, :8], adapters["c"].weights[0, "o_proj"].b) and b[:, 8:].abs().sum() == 0
    a, _ = _resident_weights(slots, "e")
    assert torch.equal(a[:8], adapters["e"].weights[0, "o_proj"].a) and a[8:].abs().sum() == 0
    _check_pool(slots)


def test_an_adapter_in_use_is_never_evicted():
    slots = _slots(max_loras=1)  # 4 pages
    slots.acquire("busy", _adapter(8, 1))
    slots.acquire("idle", _adapter(8, 2))
    slots.release("idle")
    big = _adapter(12, 3)
    assert not slots.can_acquire("big", big)  # 3 pages: only the idle one's 2 could be freed
    assert slots.can_acquire("small", _adapter(8, 4))
    slots.acquire("small", _adapter(8, 4))
    assert "busy" in slots.slot_of and "idle" not in slots.slot_of


def test_eviction_weighs_idle_time_by_reload_cost():
    """Equal cost: the least recently used goes. A rank-16 adapter (4 pages) idle as long as a rank-4 one
    stays; one whose only copy is in the store costs more to bring back than one the host tier holds."""
    slots = _slots()
    for v, r in (("old4", 4), ("old16", 16), ("new4", 4)):
        slots.acquire(v, _adapter(r, r))
    for v in ("old4", "old16", "new4"):
        slots.release(v)
    slots.acquire("x", _adapter(4, 7))  # needs one page, 1 free: no eviction
    slots.release("x")
    slots.acquire("y", _adapter(4, 8))
    assert "old4" not in slots.slot_of and {"old16", "new4", "x"} <= set(slots.slot_of)
    slots.reload_tier = lambda version: "store" if version == "new4" else "host"
    slots.acquire("z", _adapter(4, 9))  # x and new4 idle as long; new4 costs 4x to bring back
    assert "x" not in slots.slot_of and "new4" in slots.slot_of


def test_pinned_adapters_stay_and_pins_are_bounded_per_tenant():
    slots = _slots(max_loras=1, pins=1)  # 4 pages
    slots.acquire("p", _adapter(8, 1))
    slots.pin("p", "acme")
    slots.pin("p", "acme")  # again: still one pin
    slots.release("p")
    with pytest.raises(PinLimitError, match="max_pinned_adapters_per_tenant is 1"):
        slots.pin("q", "acme")
    slots.pin("q", "other")  # another tenant's bound is its own
    slots.acquire("a", _adapter(8, 2))
    slots.release("a")
    assert not slots.can_acquire("b", _adapter(12, 3))  # only a's two pages may go, never p's
    slots.acquire("b", _adapter(8, 3))
    assert "p" in slots.slot_of and "a" not in slots.slot_of
    assert slots.unpin("p") and not slots.unpin("p")
    slots.release("b")
    slots.acquire("c", _adapter(16, 4))
    assert "p" not in slots.slot_of and slots.stats().pinned == 1  # q stays pinned (not loaded)


def test_not_paged_is_one_max_rank_slot_per_adapter():
    paging = LoraPaging.of(3, MAX_RANK, None)
    assert paging == LoraPaging.of(3, MAX_RANK, MAX_RANK) and not paging.paged and paging.entries == 3
    layers = [{"o": LoraGroupBuffers.allocate(HIDDEN, (HIDDEN,), 3, MAX_RANK, torch.float32, "cpu")}]
    slots = LoraSlots(layers, 3)
    assert slots.page_table is None
    for i, v in enumerate("abcd"):
        if i == 3:
            slots.release("a")
        slots.acquire(v, _adapter(4, i))
    assert "a" not in slots.slot_of and slots.stats().pages_used == 3


@pytest.mark.parametrize("rows", [0, 3, 5])
def test_page_rows_must_be_a_power_of_two_dividing_the_max_rank(rows):
    with pytest.raises(ValueError, match="lora_page_rows"):
        LoraPaging.of(2, 24 if rows == 5 else MAX_RANK, rows or -1)


def _dora_adapter(rank: int, seed: int):
    """A DoRA adapter whose magnitudes are already its scales (as the host tier leaves them on a CPU)."""
    plain = _adapter(rank, seed)
    w = plain.weights[0, "o_proj"]
    magnitude = torch.full((HIDDEN,), 2.0)
    lora = LoraAdapter(rank, ("o_proj",), False, MappingProxyType({(0, "o_proj"): LoraWeights(w.a, w.b, 0.5, magnitude)}),
                       0, {})
    return dataclasses.replace(pack_adapter(lora, torch.float32, pin=False), magnitudes_are_scales=True)


def test_only_the_first_max_loras_entries_hold_dora_scales():
    """Entries past max_loras have no DoRA row (it would cost more than a small adapter's pages): DoRA
    adapters take the first ones, plain adapters the others first, and a DoRA adapter evicts a DoRA one."""
    slots = _slots(max_loras=2)  # 8 pages, 4 entries, 2 of them with DoRA rows
    assert slots.paging.dora_entries == 2 and slots.layers[0]["o"].dora_scale.shape[0] == 3
    slots.dora = object()  # DoRA adapters are served (their scales come precomputed: never called)
    plain = [slots.acquire(f"p{i}", _adapter(4, i)) for i in range(2)]
    assert all(s >= 2 for s in plain)
    dora = [slots.acquire(f"d{i}", _dora_adapter(4, 10 + i)) for i in range(2)]
    assert all(s < 2 for s in dora) and not slots.free_slots
    table = slots.layers[0]["o"].dora_scale
    assert bool((table[dora] == 2.0).all()) and bool((table[2] == 1.0).all())
    for v in ("p0", "d0"):
        slots.release(v)
    assert slots.can_acquire("d2", _dora_adapter(4, 12))
    slots.acquire("d2", _dora_adapter(4, 12))  # p0 idle longer, but only d0's entry has a DoRA row
    assert "d0" not in slots.slot_of and "p0" in slots.slot_of
    slots.release("d2")
    slots.release("d1")
    slots.acquire("d3", _dora_adapter(4, 13))
    freed = [s for s in range(2) if s not in slots.slot_of.values()]
    assert all(bool((table[s] == 1.0).all()) for s in freed)  # an evicted DoRA entry's row is 1.0 again


def test_gathers_are_kept_only_while_no_load_and_the_same_token_slots():
    slots = _slots()
    gathers = PageGathers(lambda: slots.loads)
    first = gathers.for_step([0, 1, -1])
    first["x"] = 1
    assert gathers.for_step([0, 1, -1]) is first
    assert gathers.for_step([1, 0, -1]) is not first  # other rows, other gathers
    kept = gathers.for_step([1, 0, -1])
    slots.acquire("a", _adapter(4, 1))  # a load may have rewritten any page
    assert gathers.for_step([1, 0, -1]) is not kept
