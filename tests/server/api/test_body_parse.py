"""The bounded JSON parse of request bodies (server/api/body.py): a list of numbers (a token batch)
is taken as it is, and whatever a list holds beside its numbers is still checked: nesting depth and
unpaired surrogates are refused wherever they sit."""
from __future__ import annotations

import json

import pytest

from server.api.body import BASE_VALUES, MAX_JSON_DEPTH, parse_json_object
from server.api.errors import APIError

pytestmark = pytest.mark.unit


def _raw(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def test_a_token_batch_parses_to_the_same_document():
    doc = {"prompt": [[5] * 2046] * 64, "logit_bias": {"7": -1.5}, "echo": True, "seed": None}
    assert parse_json_object(_raw(doc), max_values=BASE_VALUES + 64 * 2046) == doc


def test_depth_is_checked_inside_a_list_that_also_holds_numbers():
    deep: list = []
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    with pytest.raises(APIError, match="nested deeper"):
        parse_json_object(_raw({"prompt": [1, 2, 3, deep]}))
    parse_json_object(_raw({"prompt": [1, 2, 3, [[[1]]]]}))


def test_a_surrogate_beside_numbers_is_refused():
    with pytest.raises(APIError, match="surrogate"):
        parse_json_object(b'{"prompt": [1, 2.5, true, null, "\\ud800"]}')


@pytest.mark.parametrize("raw", [
    b'{"a": 1, "a": 2}', b'{"n": 123456789012345678901234}', b'{"x": [1e-400, -0.0, 1E5, 0.1]}',
    b'{"s": "\\ud83d\\ude00 \\u00e9 \\"q\\" , \\\\"}', b' {"k": [true, false, null, {}]} ',
    b'{"a": 1e400}',  # msgspec refuses it, json.loads makes it inf (as before msgspec)
])
def test_the_fast_parse_builds_what_json_loads_builds(raw):
    assert parse_json_object(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [
    b'{"a": NaN}', b'{"a": 1}x', b'{"a": "\\ud800"}', b'{"a": "\xff"}', b'\xef\xbb\xbf{}',
    b'{"a": "unterminated', b'{"a": "tab\there"}', b'{"a": 01}', b'{"a": [1,]}',
])
def test_a_body_the_fast_parse_refuses_gets_the_standard_librarys_message(raw):
    with pytest.raises(APIError) as e:
        parse_json_object(raw)
    try:
        expected = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        assert str(err) in e.value.message or "surrogate" in e.value.message or "finite" in e.value.message
    else:  # json.loads gives the surrogate a str: refused by the check after the parse
        assert e.value.code == "invalid_json", expected


def test_commas_inside_strings_do_not_count_even_beside_escaped_quotes():
    doc = {"s": ',\\"' * 5000, "t": "a,b,c\\", "ids": [1, 2]}
    assert parse_json_object(_raw(doc), max_values=3) == doc
    with pytest.raises(APIError, match="more than 2 values"):
        parse_json_object(_raw(doc), max_values=2)


def test_too_many_values_is_refused_before_the_body_is_decoded():
    raw = b'{"prompt": [' + b",".join([b"1234"] * 300_000) + b'], "x": "\xff"}'
    with pytest.raises(APIError) as e:
        parse_json_object(raw)
    assert e.value.code == "too_many_values"


def test_a_bytearray_body_parses():
    assert parse_json_object(bytearray(b'{"prompt": [1, 2]}')) == {"prompt": [1, 2]}
