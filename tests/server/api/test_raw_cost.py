"""raw_cost: a completions body's prompt lengths and cost fields read from the raw bytes, exactly, or
nothing where the bytes are not plain token ids and plain fields (the ordinary path decides then)."""
from __future__ import annotations

import json

import pytest

from server.api.raw_cost import cost_fields, prompt_lengths

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("prompt", [[1], [1, 22, 333], [[5] * 7], [[1, 2], [3], [4, 5, 6]]])
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_plain_token_ids_give_each_prompts_length(prompt, separators):
    raw = json.dumps(prompt, separators=separators).encode()
    expected = [len(p) for p in prompt] if isinstance(prompt[0], list) else [len(prompt)]
    assert prompt_lengths(raw) == expected


@pytest.mark.parametrize("raw", [b'"text"', b'["a","b"]', b"[]", b"[[]]", b"[[1],[]]", b"[1.5,2]", b"[-1,2]",
                                 b"[[1],2]", b"[1,[2]]", b"[[[1]]]", b"[[1],[[2],[3]]]", b"[[1,[2]]]", b"",
                                 b'{"a":1}'])
def test_anything_else_is_not_decided(raw):
    assert prompt_lengths(raw) is None


def test_cost_fields_as_validation_would_read_them():
    body = {"model": "m", "prompt": [[5] * 10] * 3, "echo": True, "logprobs": 20, "n": 2, "max_tokens": 4,
            "temperature": 0.5, "stop": ["x,y"]}
    fields, lengths = cost_fields(json.dumps(body).encode())
    assert lengths == [10, 10, 10]
    assert (fields.echo, fields.logprobs, fields.prompt_logprobs, fields.n, fields.max_tokens) == (True, 20, None, 2, 4)


@pytest.mark.parametrize("change", [{"logprobs": "20"}, {"logprobs": 21}, {"n": True}, {"n": 0}, {"echo": 1},
                                    {"max_tokens": -1}, {"max_tokens": 1.0}, {"prompt": "text"}])
def test_a_field_validation_might_read_differently_decides_nothing(change):
    body = {"model": "m", "prompt": [[5] * 10] * 3, "echo": True, "logprobs": 20, **change}
    assert cost_fields(json.dumps(body).encode()) is None


def test_a_body_that_is_not_json_decides_nothing():
    assert cost_fields(b'{"prompt": [1,,2], "echo": true}') is None
    assert cost_fields(b'{"prompt": [1,2], "echo": NaN}') is None
