"""The tool-call parsers on known texts: fed whole or one character at a time, they hand out the
same content and calls (what makes streamed calls equal non-streamed ones); --tool-call-parser."""
from __future__ import annotations

import json

import pytest

from server.api.prompts import ChoiceToolCalls
from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.api.tool_parsers import ForcedArgumentsParser, ForcedArrayParser, HermesParser, Llama3JsonParser
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit

NAMES = frozenset({"get_weather", "add"})


def _run(parser_factory, pieces: list[str]) -> dict:
    calls = ChoiceToolCalls(parser_factory())
    content = ""
    for i, piece in enumerate(pieces):
        text, _ = calls.absorb(piece, i == len(pieces) - 1)
        content += text
    msg = calls.message(content)
    for call in msg.get("tool_calls", ()):
        assert call["id"].startswith("call_") and call["type"] == "function"
        del call["id"]
    return msg


def _both_ways(parser_factory, text: str) -> dict:
    whole = _run(parser_factory, [text])
    assert _run(parser_factory, list(text) + [""]) == whole
    return whole


def _call(name: str, args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def test_forced_array_keeps_the_raw_parameters_of_each_call():
    text = '[{"name": "add", "parameters": {"a": 1, "b": [2, "}]"]}}, {"name": "get_weather", "parameters": {}}]'
    msg = _both_ways(ForcedArrayParser, text)
    assert msg == {"role": "assistant", "content": None, "tool_calls": [
        _call("add", '{"a": 1, "b": [2, "}]"]}'), _call("get_weather", "{}")]}


def test_forced_array_cut_off_keeps_the_partial_arguments():
    msg = _both_ways(ForcedArrayParser, '[{"name": "add", "parameters": {"a": 1')
    assert msg["tool_calls"] == [_call("add", '{"a": 1')]


def test_forced_arguments_are_the_whole_output():
    msg = _both_ways(lambda: ForcedArgumentsParser("add"), '{"a": 1}')
    assert msg["tool_calls"] == [_call("add", '{"a": 1}')]
    assert _run(lambda: ForcedArgumentsParser("add"), [""])["tool_calls"] == [_call("add", "")]


def test_hermes_reads_calls_and_keeps_the_rest_as_content():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    msg = _both_ways(lambda: HermesParser(NAMES, True), text)
    assert msg["content"] == "Let me check."
    assert msg["tool_calls"] == [_call("get_weather", '{"city": "Oslo"}'), _call("add", '{"a": 1}')]


@pytest.mark.parametrize("text", [
    "no calls here <tool_ca",
    "bad json <tool_call>{nope}</tool_call> end",
    'unknown <tool_call>{"name": "rm", "arguments": {}}</tool_call>',
    "<tool_call>cut off",
])
def test_hermes_text_that_is_no_valid_call_is_content(text):
    msg = _both_ways(lambda: HermesParser(NAMES, True), text)
    assert msg == {"role": "assistant", "content": text}


def test_hermes_without_parallel_calls_keeps_the_first():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    assert _both_ways(lambda: HermesParser(NAMES, False), text)["tool_calls"] == [_call("add", '{"a": 1}')]


def test_llama3_json_reads_separated_calls():
    text = ' {"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    msg = _both_ways(lambda: Llama3JsonParser(NAMES, True), text)
    assert msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add", "get_weather"]
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("text", ["The answer is 4.", '{"name": "rm", "parameters": {}}', '{"name": "add", "par'])
def test_llama3_json_other_text_is_content(text):
    assert _both_ways(lambda: Llama3JsonParser(NAMES, True), text) == {"role": "assistant", "content": text}


def test_the_tool_call_parser_flag(tmp_path):
    assert serve_config(tmp_path).tool_call_parser == "hermes"
    assert serve_config(tmp_path, "--tool-call-parser", "llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, tool_call_parser="mistral")
