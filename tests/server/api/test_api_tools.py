"""Tool calling over HTTP with the `openai` client and LangChain: each tool_choice mode streamed
and not, with an adapter and without. The tiny model writes gibberish; a forced call's arguments
must still validate against the function's schema, and a streamed call must equal the
non-streamed one."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from server.api.errors import APIError
from server.api.openai_requests import ChatCompletionRequest
from server.api.prompts import chat_inputs, plan_tools, request_constraint
from server.demo import CHAT_TEMPLATE
from tests.fixtures_server import api_redis_url, running_server, server_config

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Lima", "Pune"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# The tiny model's 512-token vocabulary spends ~1 token per 2 characters: tools cost ~600 prompt tokens.
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
# The SmolLM2-135M-Instruct template (the default model's): it never mentions tools.
SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("tools-data"), api_redis_url(redis_server),
                           max_schema_bytes=4096, max_model_len=1024, kv_cache_blocks=256,
                           max_num_batched_tokens=1024)
    with running_server(config, starter=core_starter) as handle:
        yield handle


@pytest.fixture(scope="module")
def key(server, tiny_adapters):
    _, key = server.new_tenant()
    assert server.upload(key, "ad", tiny_adapters["r8_all"]).status_code == 201
    return key


@pytest.fixture(scope="module")
def client(server, key):
    return server.client(key)


def _ask(client: openai.OpenAI, model: str, stream: bool, **kw) -> dict:
    """{"content", "tool_calls" (as dicts, ids kept), "finish_reason", "usage"} of choice 0, streamed
    deltas assembled the way OpenAI's clients do."""
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 0)
    r = client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), tools=TOOLS,
                                       stream=stream, **kw)
    if not stream:
        c = r.choices[0]
        calls = [tc.model_dump() for tc in c.message.tool_calls or ()]
        return {"content": c.message.content, "tool_calls": calls, "finish_reason": c.finish_reason,
                "usage": r.usage}
    content, calls, reason = "", {}, None
    for chunk in r:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                if tc.index not in calls:
                    # A call's first delta carries its id, type and name (and the arguments so far).
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "type": "function",
                                       "function": {"name": tc.function.name, "arguments": ""}}
                else:
                    assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
            reason = c.finish_reason or reason
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": reason,
            "usage": None}


def _same_calls(a: list[dict], b: list[dict]) -> None:
    """Equal calls but for their ids (fresh per response)."""
    assert [c["function"] for c in a] == [c["function"] for c in b]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in a + b)


@pytest.mark.parametrize("model", ["base", "ad"])
def test_named_function_is_forced_and_streams_the_same_call(server, client, model):
    model = server.state.model_id if model == "base" else model
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _ask(client, model, False, tool_choice=choice)
    assert whole["finish_reason"] == "tool_calls" and whole["content"] is None
    [call] = whole["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    _same_calls(_ask(client, model, True, tool_choice=choice)["tool_calls"], whole["tool_calls"])


def _close_bias(tokenizer) -> dict[str, float]:
    """A logit bias towards "]": the random model, free to add calls, would never close the array."""
    return {str(i): 6.0 for i in range(len(tokenizer)) if "]" in tokenizer.decode([i])}


@pytest.mark.parametrize("model", ["base", "ad"])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_offered_functions_with_valid_arguments(server, client, tiny_model_dir, model, parallel):
    model = server.state.model_id if model == "base" else model
    bias = _close_bias(AutoTokenizer.from_pretrained(tiny_model_dir))
    for seed in (1, 2, 3):
        kw = dict(tool_choice="required", parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200,
                  logit_bias=bias)
        whole = _ask(client, model, False, **kw)
        assert whole["finish_reason"] == "tool_calls", whole
        assert whole["content"] is None and whole["tool_calls"]
        if not parallel:
            assert len(whole["tool_calls"]) == 1
        for call in whole["tool_calls"]:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        streamed = _ask(client, model, True, **kw)
        assert streamed["finish_reason"] == "tool_calls"
        _same_calls(streamed["tool_calls"], whole["tool_calls"])


def test_required_with_parallel_calls_makes_several(server, client, tiny_model_dir):
    # A weaker pull towards "]" than above: this seed's sample makes two calls before closing.
    bias = {k: 4.0 for k in _close_bias(AutoTokenizer.from_pretrained(tiny_model_dir))}
    kw = dict(tool_choice="required", temperature=1.0, seed=2, max_tokens=200, logit_bias=bias)
    whole = _ask(client, server.state.model_id, False, **kw)
    assert whole["finish_reason"] == "tool_calls" and len(whole["tool_calls"]) >= 2, whole
    for call in whole["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    _same_calls(_ask(client, server.state.model_id, True, **kw)["tool_calls"], whole["tool_calls"])


HERMES_CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'


@pytest.mark.parametrize("model", ["base", "ad"])
def test_auto_reads_hermes_calls_and_streams_them_the_same(server, client, model):
    model = server.state.model_id if model == "base" else model
    # The random model never writes a call of its own accord: a regex makes it write one, which
    # the hermes parser reads like any model's.
    kw = dict(tool_choice="auto", extra_body={"guided_regex": r"Sure\. " + HERMES_CALL})
    whole = _ask(client, model, False, **kw)
    assert whole["finish_reason"] == "tool_calls" and whole["content"] == "Sure."
    [call] = whole["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)
    streamed = _ask(client, model, True, **kw)
    assert streamed["content"] == "Sure." and streamed["finish_reason"] == "tool_calls"
    _same_calls(streamed["tool_calls"], whole["tool_calls"])


LLAMA3_CALL = r'\{"name": "add", "parameters": \{"a": [1-9], "b": [1-9]\}\}'


def test_auto_reads_llama3_json_calls_with_that_parser(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    # Beside the module's server on the same Redis db: not flushed, under a prefix of its own.
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("tools-llama3"),
                           api_redis_url(redis_server, flush=False), redis_prefix="lp-llama3:",
                           max_model_len=1024, kv_cache_blocks=256, max_num_batched_tokens=1024,
                           tool_call_parser="llama3_json")
    with running_server(config, starter=core_starter) as llama3:
        _, key = llama3.new_tenant()
        client = llama3.client(key)
        kw = dict(tool_choice="auto", extra_body={"guided_regex": LLAMA3_CALL + "; " + LLAMA3_CALL})
        whole = _ask(client, llama3.state.model_id, False, **kw)
        assert whole["finish_reason"] == "tool_calls" and whole["content"] is None
        assert [c["function"]["name"] for c in whole["tool_calls"]] == ["add", "add"]
        for call in whole["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)
        _same_calls(_ask(client, llama3.state.model_id, True, **kw)["tool_calls"], whole["tool_calls"])
        # A Hermes block is no call for this parser: content.
        out = _ask(client, llama3.state.model_id, False, tool_choice="auto", extra_body={"guided_regex": HERMES_CALL})
        assert out["tool_calls"] == [] and out["content"].startswith("<tool_call>")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_without_a_call_the_answer_is_content(server, client, choice, stream):
    model = server.state.model_id
    plain = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12)
    out = _ask(client, model, stream, tool_choice=choice, max_tokens=12)
    assert out["tool_calls"] == [] and out["finish_reason"] in ("stop", "length")
    assert out["content"]
    if not stream:
        # The tools reach the template: the prompt grows by their text.
        assert out["usage"].prompt_tokens > plain.usage.prompt_tokens


def test_tool_messages_fed_back_render_through_the_template(server, client, tiny_model_dir):
    model = server.state.model_id
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [{"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    out = _ask(client, model, False, messages=messages, max_tokens=4)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
    text = tok.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<|tool|>\n5" in text
    assert out["usage"].prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def test_langchain_tool_calling_agent_loop(server, key):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class AddArgs(BaseModel):
        # Bounded: the random model would otherwise write digits until max_tokens.
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two small integers."""
        return a + b

    llm = ChatOpenAI(model=server.state.model_id, base_url=f"{server.url}/v1", api_key=key, temperature=0,
                     max_tokens=100, max_retries=0)
    history = [HumanMessage("What is 2 + 3? Use the tool.")]
    # LangChain's "any" is "required"; one call (the random model would never close a list of them).
    first = llm.bind_tools([add], tool_choice="any", parallel_tool_calls=False).invoke(history)
    assert first.tool_calls and first.tool_calls[0]["name"] == "add"
    history.append(first)
    for call in first.tool_calls:
        args = call["args"]
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
        history.append(ToolMessage(str(add.invoke(args)), tool_call_id=call["id"]))
    final = llm.bind_tools([add]).invoke(history)  # auto: the random model answers in text
    assert not final.tool_calls and isinstance(final.content, str) and final.content
    assert final.response_metadata["finish_reason"] in ("stop", "length")


def _error(client: openai.OpenAI, model: str, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kw)
    return err.value.body


@pytest.mark.parametrize("model", ["base", "ad"])
@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}], "guided_regex": "a+"},
     "guided_regex"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "messages": MESSAGES + [{"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    ({"tools": TOOLS, "messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tools_are_400_naming_the_field(server, client, model, fields, param):
    model = server.state.model_id if model == "base" else model
    fields = dict(fields)
    messages = fields.pop("messages", MESSAGES)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, extra_body=fields)
    assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize("template", [SMOL_TEMPLATE, CHAT_TEMPLATE.replace("{%- if tools -%}", "{%- if false -%}")
                                      .replace("for tool in tools", "for tool in []")])
def test_a_template_that_cannot_render_tools_is_a_400(template):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": TOOLS})
    with pytest.raises(APIError) as err:
        chat_inputs(req, plan_tools(req, "hermes", 4096), template)
    assert err.value.status == 400 and err.value.param == "tools"
    assert "cannot render tools" in err.value.message
    tool_msg = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MESSAGES + [{"role": "tool", "content": "5", "tool_call_id": "c"}]})
    with pytest.raises(APIError) as err:
        chat_inputs(tool_msg, None, template)
    assert err.value.param == "messages"


def test_tool_call_requests_are_counted(server, client):
    _ask(client, server.state.model_id, False, tool_choice="none", max_tokens=2)
    with server.http(server.config.admin_token) as h:
        text = h.get("/metrics").text
    assert 'loraplex_tool_call_requests_total{mode="none"}' in text


def test_each_of_n_choices_gets_its_own_calls(server, client):
    kw = dict(model="ad", messages=MESSAGES, tools=TOOLS, n=2, temperature=1.0, seed=5, max_tokens=120,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    args: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                assert tc.index == 0  # the call's index within its choice
                args[c.index] += tc.function.arguments or ""
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)
        assert args[c.index] == c.message.tool_calls[0].function.arguments


STRICT_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
                {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def _accepts(grammars, spec, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    return matcher.accept_string(text) and matcher.accept_token(grammars.info.stop_token_ids[0])


@pytest.mark.parametrize("parser,call", [
    ("hermes", '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'),
    ("llama3_json", '{{"name": "{name}", "parameters": {args}}}')])
def test_auto_with_a_strict_function_holds_the_calls_to_its_schema(server, parser, call):
    # As vLLM does (a structural tag when a tool is strict): the model may answer in text, and a
    # call it writes names an offered function, with arguments valid for a strict one's schema.
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": STRICT_TOOLS,
                                                "tool_choice": "auto"})
    constraint = request_constraint(req, plan_tools(req, parser, 4096), 4096)
    assert constraint.param == "tools" and constraint.spec.kind == "structural_tag"
    grammars = server.state.grammar_compiler.grammars
    ok = call.format(name="add", args='{"a": 1, "b": 2}')
    assert _accepts(grammars, constraint.spec, "No call needed.")
    assert _accepts(grammars, constraint.spec, "Sure. " + ok)
    assert not _accepts(grammars, constraint.spec, "Sure. " + call.format(name="add", args='{"a": 100, "b": 2}'))
    assert not _accepts(grammars, constraint.spec, "Sure. " + call.format(name="add", args='{"a": 1}'))
    assert not _accepts(grammars, constraint.spec, "Sure. " + call.format(name="nope", args='{"a": 1, "b": 2}'))
    # get_weather is not strict: any object for it
    assert _accepts(grammars, constraint.spec, call.format(name="get_weather", args='{"x": [1]}'))
    assert _accepts(grammars, constraint.spec, ok + " " + ok)
    sequential = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": STRICT_TOOLS,
                                                       "tool_choice": "auto", "parallel_tool_calls": False})
    one_call = request_constraint(sequential, plan_tools(sequential, parser, 4096), 4096).spec
    assert _accepts(grammars, one_call, "Sure. " + ok) and not _accepts(grammars, one_call, ok + " " + ok)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_a_strict_function_is_served_constrained(server, client, stream):
    def constrained() -> int:
        with server.http(server.config.admin_token) as h:
            return h.get("/admin/engine").json()["structured_output"]["constrained_requests"]

    before = constrained()
    r = client.chat.completions.create(model="ad", messages=MESSAGES, tools=STRICT_TOOLS, tool_choice="auto",
                                       max_tokens=12, temperature=0, stream=stream)
    if stream:
        reasons = [c.finish_reason for chunk in r for c in chunk.choices if c.finish_reason]
        assert reasons and reasons[-1] in ("stop", "length", "tool_calls")
    else:
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert constrained() == before + 1
