"""--chat-template (a file, template text or shipped name), the shipped smollm2-tools template read
back by the hermes parser, and vLLM's --enable-auto-tool-choice / --tool-call-parser, on the tiny model."""
from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from server.api.openai_requests import ChatCompletionRequest
from server.api.prompts import chat_inputs, plan_tools
from server.api.tool_parsers import HermesParser
from server.chat_templates import SHIPPED_DIR, resolve_chat_template
from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.server.api.test_api_tools import SMOL_TEMPLATE

SMOL_TOOLS = (SHIPPED_DIR / "smollm2-tools.jinja").read_text(encoding="utf-8")
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two digits", "parameters": ADD}}]
AGENT_TURNS = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]


def test_chat_template_takes_a_name_a_file_or_the_text(tmp_path):
    assert resolve_chat_template("smollm2-tools", default_model=False) == SMOL_TOOLS
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert resolve_chat_template(str(path), default_model=False) == "{{ messages[0]['content'] }}"
    assert resolve_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", default_model=False)
    assert resolve_chat_template(None, default_model=False) is None  # the tokenizer's own
    assert resolve_chat_template(None, default_model=True) == SMOL_TOOLS  # the default model gets tools


def test_a_bad_chat_template_is_one_line_naming_the_flag(tmp_path):
    args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                      "--chat-template", "no-such-template"])
    with pytest.raises(ConfigError) as err:
        ServerConfig.from_args(args, env={})
    message = str(err.value)
    assert "\n" not in message and message.startswith("--chat-template") and "smollm2-tools" in message


def test_vllm_tool_flags_are_accepted(tmp_path):
    args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--chat-template", "smollm2-tools"])
    config = ServerConfig.from_args(args, env={})
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    assert config.chat_template_text() == SMOL_TOOLS
    off = build_parser().parse_args(["serve", "--no-enable-auto-tool-choice"])
    assert off.enable_auto_tool_choice is False


def test_smollm2_tools_renders_an_agent_turn_the_hermes_parser_reads_back(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": AGENT_TURNS, "tools": TOOLS})
    messages, tools = chat_inputs(req, plan_tools(req, "hermes", 4096), SMOL_TOOLS)
    text = tok.apply_chat_template(messages, tools=tools, chat_template=SMOL_TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The assistant's call, as the template wrote it, is what --tool-call-parser hermes reads.
    written = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parser = HermesParser(frozenset({"add"}), parallel=True)
    parsed = parser.feed(written)
    parsed.add(parser.finish())
    assert parsed.content == "" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
])
def test_without_tools_smollm2_tools_renders_as_smollm2s_own(tiny_model_dir, messages):
    """The default model's prompts without tools are what its own template wrote before."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for generation_prompt in (True, False):
        assert tok.apply_chat_template(messages, chat_template=SMOL_TOOLS, tokenize=False,
                                       add_generation_prompt=generation_prompt) == \
            tok.apply_chat_template(messages, chat_template=SMOL_TEMPLATE, tokenize=False,
                                    add_generation_prompt=generation_prompt)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("template-data"), api_redis_url(redis_server),
                           chat_template="smollm2-tools", enable_auto_tool_choice=False, max_model_len=1024,
                           kv_cache_blocks=256, max_num_batched_tokens=1024)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def test_no_auto_tool_choice_refuses_auto_as_vllm_and_keeps_forced_calls(server):
    client = server.client(server.new_tenant()[1])
    model = server.state.model_id
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model=model, messages=AGENT_TURNS[:1], tools=TOOLS, max_tokens=8)
    reply = client.chat.completions.create(model=model, messages=AGENT_TURNS, tools=TOOLS, max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    plain = client.chat.completions.create(model=model, messages=AGENT_TURNS, tools=TOOLS, tool_choice="none",
                                           max_tokens=4)
    assert plain.choices[0].message.tool_calls is None
