"""Every request parameter in the HTTP API reference's table (docs/http-api.md), through the `openai` client: supported ones for
their effect, refused ones for the 400 that names them, ignored ones for an unchanged answer."""
from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from tests.repo import ROOT_DIR

HTTP_API = ROOT_DIR / "docs" / "http-api.md"
PROMPT = [3, 14, 15, 92, 65]
CHAT = [{"role": "user", "content": "hi"}]


def readme_rows() -> dict[str, tuple[str, str]]:
    """parameter -> (completions, chat) as docs/http-api.md's table states them."""
    text = HTTP_API.read_text()
    table = text[text.index("| parameter | /v1/completions"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[re.sub(r"[`]", "", cells[0])] = (cells[1], cells[2])
    return rows


class Calls:
    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.c = client
        self.model = model

    def complete(self, **kw):
        kw.setdefault("max_tokens", 8)
        kw.setdefault("temperature", 0)
        extra = kw.pop("extra_body", {})
        return self.c.completions.create(model=self.model, prompt=kw.pop("prompt", PROMPT),
                                         extra_body={"ignore_eos": True, **extra}, **kw)

    def chat(self, **kw):
        kw.setdefault("max_tokens", 8)
        kw.setdefault("temperature", 0)
        extra = kw.pop("extra_body", {})
        return self.c.chat.completions.create(model=self.model, messages=kw.pop("messages", CHAT),
                                              extra_body={"ignore_eos": True, **extra}, **kw)

    def text(self, chat: bool, **kw) -> str:
        r = self.chat(**kw) if chat else self.complete(**kw)
        return r.choices[0].message.content if chat else r.choices[0].text


def effects(calls: Calls, tokenizer, chat: bool, first: int):
    """Per supported parameter: a check that it changes what it should. `first`: the greedy first token."""
    greedy = calls.text(chat)
    gen = calls.chat if chat else calls.complete

    def sampled(**kw) -> str:
        return calls.text(chat, temperature=1.0, seed=7, max_tokens=16, **kw)

    def service_tier():
        # One tier: "auto" and "default" change nothing; a tier it does not have is refused, naming it.
        assert calls.text(chat, extra_body={"service_tier": "default", "metadata": {"k": "v"}}) == greedy
        with pytest.raises(openai.BadRequestError) as err:
            calls.text(chat, extra_body={"service_tier": "flex"})
        assert "service_tier" in err.value.body["message"]

    def n():
        r = gen(n=3)
        assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]

    def stop():
        cut = greedy[2:5]
        assert cut and calls.text(chat, stop=[cut]) == greedy[:greedy.index(cut)]

    def stream():
        pieces = list(gen(stream=True, stream_options={"include_usage": True}))
        # Tokens a slow reader has not taken yet arrive together, so a loaded machine may send all 8 in one
        # chunk: the text is what is checked, not how many chunks carried it.
        streamed = "".join((c.delta.content or "") if chat else c.text for p in pieces[:-1] for c in p.choices)
        assert pieces[-1].usage.completion_tokens == 8 and not pieces[-1].choices and streamed == greedy

    def penalty(name: str, value: float):
        def check():
            assert calls.text(chat, max_tokens=40, extra_body={name: value}) != calls.text(chat, max_tokens=40)
        return check

    def logit_bias():
        assert calls.text(chat, logit_bias={str(first): -100}) != greedy
        forced = next(t for t in range(100, 200) if t != first)
        assert calls.text(chat, logit_bias={str(forced): 100}, max_tokens=2) == tokenizer.decode([forced] * 2)

    def min_tokens():
        stopped = gen(extra_body={"stop_token_ids": [first], "ignore_eos": True})
        assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
        held = gen(extra_body={"stop_token_ids": [first], "min_tokens": 5})
        assert held.usage.completion_tokens >= 5

    def ignore_eos():
        eos = tokenizer.eos_token_id
        bias = {str(eos): 100}
        r = gen(logit_bias=bias, extra_body={"ignore_eos": False})
        assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
        assert gen(logit_bias=bias).usage.completion_tokens == 8

    def logprobs():
        if chat:
            r = gen(logprobs=True, top_logprobs=2)
            assert len(r.choices[0].logprobs.content) == 8 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
        else:
            assert len(calls.complete(logprobs=2).choices[0].logprobs.top_logprobs) == 8

    def prompt_logprobs():
        r = gen(extra_body={"prompt_logprobs": 1})
        entries = r.model_extra["prompt_logprobs"] if chat else r.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) > 1 and all(len(e) <= 2 for e in entries[1:])

    def cache_salt():
        import secrets
        salt = secrets.token_hex(8)
        long = {"messages": [{"role": "user", "content": "tell me more " * 12}]} if chat else \
            {"prompt": list(range(30, 80))}

        def cached(s: str) -> int:
            return gen(extra_body={"cache_salt": s}, **long).usage.prompt_tokens_details.cached_tokens
        assert cached(salt) == 0 and cached(salt) >= 16 and cached(salt + "-other") == 0

    def response_format():
        schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                  "additionalProperties": False}
        text = calls.text(chat, max_tokens=60, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}})
        assert isinstance(json.loads(text)["a"], bool)

    def guided():
        choices = ["alpha", "beta"]
        assert calls.text(chat, max_tokens=20, extra_body={"guided_choice": choices}) in choices

    def tools():
        fn = {"name": "pick", "parameters": {"type": "object", "properties": {"x": {"enum": ["a", "b"]}},
                                             "required": ["x"], "additionalProperties": False}}
        r = calls.chat(max_tokens=40, tools=[{"type": "function", "function": fn}],
                       tool_choice={"type": "function", "function": {"name": "pick"}})
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
        assert json.loads(call.function.arguments)["x"] in ("a", "b")

    def priority():
        assert calls.text(chat, extra_body={"priority": -5}) == greedy  # ordering only: same answer

    def speculative():
        # Speed only: the same answer (its effect on drafts: tests/server/api/test_api_speculative.py).
        assert calls.text(chat, extra_body={"speculative": False}) == greedy

    return {
        "model": lambda: None,
        "prompt": lambda: len(calls.complete(prompt=[PROMPT, PROMPT[:3]]).choices) == 2 or pytest.fail(),
        "messages": lambda: None,
        "max_tokens": lambda: calls.complete(max_tokens=3).usage.completion_tokens == 3 or pytest.fail(),
        "max_completion_tokens": lambda: gen(max_completion_tokens=3).usage.completion_tokens == 3 or pytest.fail(),
        "temperature": lambda: sampled() != calls.text(chat, max_tokens=16) or pytest.fail(),
        "top_p": lambda: sampled(top_p=1e-9) == calls.text(chat, max_tokens=16) or pytest.fail(),
        "n": n,
        "best_of": lambda: len(gen(n=2, best_of=2).choices) == 2 or pytest.fail(),
        "stream": stream,
        "stream_options": stream,
        "stop": stop,
        "seed": lambda: (sampled() == sampled() and sampled() != calls.text(chat, temperature=1.0, seed=8,
                                                                             max_tokens=16)) or pytest.fail(),
        "presence_penalty": penalty("presence_penalty", 2.0),
        "frequency_penalty": penalty("frequency_penalty", 2.0),
        "repetition_penalty": penalty("repetition_penalty", 3.0),
        "logit_bias": logit_bias,
        "logprobs": logprobs,
        "top_logprobs": logprobs,
        "echo": lambda: calls.complete(prompt="abc", echo=True, max_tokens=2).choices[0].text.startswith("abc")
        or pytest.fail(),
        "user": lambda: calls.text(chat, user="someone") == greedy or pytest.fail(),
        "service_tier": service_tier,
        "top_k": lambda: sampled(extra_body={"top_k": 1}) == calls.text(chat, max_tokens=16) or pytest.fail(),
        "min_p": lambda: sampled(extra_body={"min_p": 1.0}) == calls.text(chat, max_tokens=16) or pytest.fail(),
        "min_tokens": min_tokens,
        "ignore_eos": ignore_eos,
        "stop_token_ids": min_tokens,
        "prompt_logprobs": prompt_logprobs,
        "priority": priority,
        "response_format": response_format,
        "guided_json": guided,
        "tools": tools,
        "cache_salt": cache_salt,
        "speculative": speculative,
    }


REFUSED_VALUES = {
    "max_completion_tokens": 4, "echo": True, "suffix": "x",
    "functions": [{"name": "f", "parameters": {}}], "use_beam_search": True,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "truncate_prompt_tokens": 4,
    "allowed_token_ids": [1, 2], "chat_template": "{{ messages }}",
}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_readme_parameter(api_server, tiny_model_dir, peft_oracle, endpoint):
    _, key = api_server.new_tenant()
    model = api_server.state.model_id
    calls = Calls(api_server.client(key), model)
    chat = endpoint == "chat"
    if chat:
        with api_server.http(key) as h:
            prompt = h.post("/tokenize", json={"model": model, "messages": CHAT}).json()["tokens"]
    else:
        prompt = PROMPT
    first = peft_oracle(tiny_model_dir, None, prompt, 1)[0]
    checks = effects(calls, api_server.tokenizer, chat, first)
    rows = readme_rows()
    assert len(rows) >= 35
    for param, statuses in rows.items():
        status = statuses[1 if chat else 0]
        if status == "-":
            continue
        if status == "yes":
            assert param in checks, f"no effect check for {param}"
            checks[param]()
        elif status == "ignored":
            assert calls.text(chat, **{param: "someone"}) == calls.text(chat), param
        else:
            assert status == "400", (param, status)
            body = {param: REFUSED_VALUES[param]}
            with pytest.raises(openai.BadRequestError) as err:
                (calls.chat if chat else calls.complete)(extra_body=body)
            assert param in err.value.body["message"], (param, err.value.body)
