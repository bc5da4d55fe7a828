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
