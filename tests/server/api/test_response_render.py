"""A non-streamed response body (server.api.openai_routes._render): msgspec's one short C call, the same
JSON values json.dumps wrote, every float exactly (a float may be spelled differently: -3.75e-05 is
-0.0000375), text unescaped UTF-8, for an echo with top logprobs."""
from __future__ import annotations

import json

import pytest

from server.api.openai_routes import _render

pytestmark = pytest.mark.unit


def test_the_body_is_the_document_json_dumps_wrote():
    n = 300
    tops = [None] + [{f"t{j}é{i % 7}": -0.5 * j - i / n for j in range(20)} for i in range(1, n)]
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "text": "héllo \u2028 \"quoted\" \n\u0001 😀", "finish_reason": "length",
                         "logprobs": {"tokens": [f"t{i}" for i in range(n)],
                                      "token_logprobs": [None] + [-1.25e-7 * i for i in range(1, n)],
                                      "top_logprobs": tops, "text_offset": list(range(n))}}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}}
    out = _render(body)
    assert json.loads(out) == body  # floats compare exactly: each spelling round-trips to the same double
    assert "é".encode() in out and b"\\u0001" in out and b", " not in out and b": " not in out
