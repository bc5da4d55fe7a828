"""Log-probabilities through the `openai` client, against transformers + peft in float32: completions
`logprobs` and `echo` (scoring with max_tokens 0), chat `logprobs`/`top_logprobs`, vLLM's
`prompt_logprobs`, for adapters and the base model in one mixed set of concurrent requests."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

TOL = 1e-4


@pytest.fixture(scope="module")
def peft_logprobs(tiny_model_dir):
    """Factory: (adapter_dir | None, token ids) -> [len-1, V] log_softmax of the next-token logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict = {}

    @torch.inference_mode()
    def run(adapter_dir: Path | None, ids: list[int]) -> torch.Tensor:
        if adapter_dir not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            if adapter_dir is not None:
                model = PeftModel.from_pretrained(model, adapter_dir)
            models[adapter_dir] = model.eval()
        logits = models[adapter_dir](input_ids=torch.tensor([ids])).logits[0]  # [L, V]
        return torch.log_softmax(logits.float(), dim=-1)[:-1]  # position i predicts token i + 1

    return run


def _ids(server, text: str) -> list[int]:
    return server.tokenizer(text).input_ids


def test_echo_scoring_matches_peft_for_mixed_adapters(api_server, tiny_adapters, peft_logprobs):
    _, key = api_server.new_tenant()
    for name in ("r8_all", "r16_rslora"):
        assert api_server.upload(key, name.replace("_", "-"), tiny_adapters[name]).status_code == 201
    c = api_server.client(key)
    base = api_server.state.model_id
    cases = [(base, None), ("r8-all", tiny_adapters["r8_all"]), ("r16-rslora", tiny_adapters["r16_rslora"])]
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = _ids(api_server, prompt)

    def score(model):
        return c.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=3)

    with ThreadPoolExecutor(len(cases)) as pool:  # concurrent: they share engine steps
        results = list(pool.map(score, [m for m, _ in cases]))
    for (model, adapter), r in zip(cases, results):
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = peft_logprobs(adapter, ids)
        for pos in range(1, len(ids)):
            assert math.isclose(lp.token_logprobs[pos], float(expected[pos - 1, ids[pos]]), abs_tol=TOL), model
            _check_top(lp.top_logprobs[pos], expected[pos - 1], 3)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def _tokenize(server, key: str, body: dict) -> list[int]:
    with server.http(key) as h:
        r = h.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _check_top(got: dict[str, float], row: torch.Tensor, k: int) -> None:
    """The top-k alternatives (keyed by token text, so ids that read alike share one entry)."""
    top = [float(v) for v in torch.topk(row, k).values]
    values = sorted(got.values(), reverse=True)
    assert 1 <= len(values) <= k and math.isclose(values[0], top[0], abs_tol=TOL)
    assert all(any(math.isclose(v, t, abs_tol=TOL) for t in top) for v in values)


def _byte_pieces(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token's exact bytes, read off the byte-level vocabulary with GPT-2's own table."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(back[c] for c in piece) for piece in tokenizer.convert_ids_to_tokens(ids)]


def test_generated_logprobs_match_peft(api_server, tiny_model_dir, tiny_adapters, peft_logprobs, peft_oracle):
    _, key = api_server.new_tenant()
    assert api_server.upload(key, "pat", tiny_adapters["r32_pattern"]).status_code == 201
    c = api_server.client(key)
    prompt_ids = [5, 77, 301, 12, 9]
    for model, adapter in ((api_server.state.model_id, None), ("pat", tiny_adapters["r32_pattern"])):
        r = c.completions.create(model=model, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=5,
                                 extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        generated = peft_oracle(tiny_model_dir, adapter, prompt_ids, 8)
        expected = peft_logprobs(adapter, prompt_ids + generated)
        assert len(lp.token_logprobs) == 8
        for i, value in enumerate(lp.token_logprobs):
            row = expected[len(prompt_ids) - 1 + i]
            assert math.isclose(value, float(row[generated[i]]), abs_tol=TOL)
            _check_top(lp.top_logprobs[i], row, 5)


def test_chat_logprobs_and_top_logprobs(api_server, tiny_model_dir, peft_logprobs, peft_oracle):
    _, key = api_server.new_tenant()
    c = api_server.client(key)
    model = api_server.state.model_id
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = c.chat.completions.create(model=model, messages=messages, max_completion_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    prompt = _tokenize(api_server, key, {"model": model, "messages": messages})
    generated = peft_oracle(tiny_model_dir, None, prompt, 6)
    tok = api_server.tokenizer
    assert [bytes(t.bytes) for t in content] == _byte_pieces(tok, generated)
    expected = peft_logprobs(None, prompt + generated)
    for i, t in enumerate(content):
        row = expected[len(prompt) - 1 + i]
        assert math.isclose(t.logprob, float(row[generated[i]]), abs_tol=TOL)
        assert len(t.top_logprobs) == 4 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=TOL)
    # "developer" is OpenAI's new name for "system": the same prompt
    system = [{"role": "system", "content": "be brief"}, messages[1]]
    assert _tokenize(api_server, key, {"model": model, "messages": system}) == prompt


def test_prompt_logprobs_extra(api_server, peft_logprobs):
    _, key = api_server.new_tenant()
    ids = [3, 14, 15, 92, 65, 35]
    r = api_server.client(key).completions.create(model=api_server.state.model_id, prompt=ids, max_tokens=1,
                                                  extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    expected = peft_logprobs(None, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for pos in range(1, len(ids)):
        assert math.isclose(entries[pos][str(ids[pos])]["logprob"], float(expected[pos - 1, ids[pos]]), abs_tol=TOL)
        assert len(entries[pos]) <= 3  # the prompt's token and the top 2
