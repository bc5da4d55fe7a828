"""ValueCounter: the count over a body's bytes as they arrive is the whole body's count, wherever the
chunks split it, and refuses as soon as the bound is passed."""
from __future__ import annotations

import pytest

from server.api.errors import APIError
from server.api.value_count import ValueCounter

pytestmark = pytest.mark.unit


def _fed(raw: bytes, step: int, max_values: int = 1 << 20) -> ValueCounter:
    counter = ValueCounter(max_values)
    for end in range(step, len(raw) + step, step):
        counter.feed(raw, min(end, len(raw)))
    return counter


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1 << 20])
def test_chunks_count_as_the_whole(step):
    raw = b'{"a,b": [1,2,3], "c": "x,y,\\u002c", "d": {"e": [[4,5],[6]]}, "": ""}'
    counter = _fed(raw, step)
    assert counter.complete
    assert (counter.values, counter.strings) == (7, 7)  # commas outside strings; string literals


def test_an_escaped_quote_leaves_the_count_to_the_decoded_text():
    counter = _fed(b'{"a\\"b": [1,2]}', 1)
    assert not counter.complete


def test_a_string_still_open_is_not_a_complete_count():
    counter = ValueCounter(10)
    counter.feed(b'{"abc', 5)
    assert not counter.complete


def test_refused_in_the_chunk_that_passes_the_bound():
    raw = b"[" + b"1," * 100 + b"1]"
    counter = ValueCounter(50)
    counter.feed(raw, 90)  # 44 commas so far
    with pytest.raises(APIError) as e:
        counter.feed(raw, 120)
    assert e.value.status == 400 and e.value.code == "too_many_values" and "more than 50 values" in e.value.message
