"""Token-id arrays validated at C speed (server/api/token_id_lists.py): parse_model builds the same
model pydantic builds, and every body msgspec's check does not accept gets pydantic's own refusal."""
from __future__ import annotations

import pytest

from server.api.body import parse_model
from server.api.errors import APIError
from server.api.openai_requests import CompletionRequest, DetokenizeRequest, MAX_DETOKENIZE_IDS
from server.api.token_id_lists import TOKEN_ID_MAX

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("prompt", [[[5] * 300] * 8, [0, 1, TOKEN_ID_MAX], [[1], [2, 3]], "text", ["a", "b"]])
def test_the_model_equals_pydantics(prompt):
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    fast = parse_model(CompletionRequest, body)
    assert fast == CompletionRequest.model_validate(body)
    assert fast.prompt == prompt and fast.prompts() == CompletionRequest.model_validate(body).prompts()


def _pydantic_refusal(cls, body: dict) -> str:
    with pytest.raises(APIError) as e:
        parse_model(cls, body)
    return e.value.message


@pytest.mark.parametrize("prompt", [[[1], []], [], [[]], [1, True], [[1, 2.0]], [-1], [TOKEN_ID_MAX + 1],
                                    [[1], [TOKEN_ID_MAX + 1]], [[1], 2], [1, [2]], [[1, "2"]]])
def test_what_msgspec_does_not_accept_gets_pydantics_refusal(prompt):
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    try:
        CompletionRequest.model_validate(body)
    except ValueError:
        message = _pydantic_refusal(CompletionRequest, body)
        assert "prompt" in message
    else:  # pydantic's lax mode takes it (a bool or an integral float): so does parse_model, the same way
        assert parse_model(CompletionRequest, body) == CompletionRequest.model_validate(body)


def test_detokenize_ids_keep_their_bound_and_take_no_batch():
    assert parse_model(DetokenizeRequest, {"model": "m", "tokens": [7] * 10}).tokens == [7] * 10
    assert parse_model(DetokenizeRequest, {"model": "m", "tokens": []}).tokens == []
    assert "tokens" in _pydantic_refusal(DetokenizeRequest, {"model": "m", "tokens": [7] * (MAX_DETOKENIZE_IDS + 1)})
    assert "tokens" in _pydantic_refusal(DetokenizeRequest, {"model": "m", "tokens": [[7]]})
