"""Structured output's strings are valid JSON whatever xgrammar 0.2.8 lowers (mlc-ai/xgrammar#800):
length-bounded strings, property names, patterns' literals and email's quoted pair, through the
project's own compile path (server.engine.grammar) and sampled from the tiny model."""
from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from server.engine import LLM, SamplingParams, StructuredOutputsParams
from server.engine.grammar import Grammars
from server.engine.json_string_safety import json_string_pattern
from tests.engine_helpers import random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512


@pytest.fixture(scope="module")
def grammars(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return Grammars(tokenizer, VOCAB, {tokenizer.eos_token_id})


def accepts(grammars: Grammars, spec: StructuredOutputsParams, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


BOUNDED = StructuredOutputsParams(json={"type": "string", "minLength": 1, "maxLength": 3})


@pytest.mark.parametrize("text, ok", [
    ('"a\x01"', False), ('"\x1f"', False), ('"a\nb"', False), ('"\\"', False), ('"\\q"', False),
    ('"ab"', True), ('"a\\nb"', True), ('"\\u0001"', True), ('"\\\\\\"\\/"', True), ('"é"', True),
    ('""', False), ('"abcd"', False), ('"\\ud83d"', False),  # a lone surrogate half is no code point
])
def test_a_length_bounded_string_admits_escapes_and_no_raw_controls(grammars, text, ok):
    assert accepts(grammars, BOUNDED, text) is ok


def test_property_names_with_a_length_bound(grammars):
    spec = StructuredOutputsParams(json={"type": "object", "propertyNames": {"maxLength": 2},
                                         "additionalProperties": {"type": "integer"}})
    assert accepts(grammars, spec, '{"\\t": 1}')
    assert not accepts(grammars, spec, '{"\t": 1}')


@pytest.mark.parametrize("pattern, good, bad", [
    (r"^a\nb$", '"a\\nb"', '"a\nb"'),
    ('^"$', '"\\""', '"""'),
    (r"^\\$", '"\\\\"', '"\\"'),
    (r"^\x01+$", '"\\u0001\\u0001"', '"\x01"'),
    (r"^[\t a]+\.$", '" a."', '"\t."'),
])
def test_a_patterns_literals_are_written_escaped(grammars, pattern, good, bad):
    spec = StructuredOutputsParams(json={"type": "string", "pattern": pattern})
    assert accepts(grammars, spec, good) and not accepts(grammars, spec, bad)
    assert jsonschema.Draft202012Validator({"pattern": pattern}).is_valid(json.loads(good))


def test_pattern_rewrite_keeps_classes_and_escaped_metacharacters():
    assert json_string_pattern(r"^[\"\\]\d\.x$") == r"^[\"\\]\d\.x$"
    assert json_string_pattern('a"') == r'a(?:\\")'


def test_emails_quoted_pair_is_a_json_escape(grammars):
    spec = StructuredOutputsParams(json={"type": "string", "format": "email"})
    assert accepts(grammars, spec, '"\\"\\\\a\\"@x.io"')  # "\a"@x.io
    assert not accepts(grammars, spec, '"\\"\\a\\"@x.io"')  # \a: no JSON escape
    assert accepts(grammars, spec, '"me@x.io"')


def test_a_structural_tags_schemas_are_repaired(grammars):
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"type": "tag", "begin": "<f>", "end": "</f>",
         "content": {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 4}}}]}}
    spec = StructuredOutputsParams(structural_tag=tag)
    assert accepts(grammars, spec, 'hi <f>"a\\n"</f>')
    assert not accepts(grammars, spec, 'hi <f>"a\x02"</f>')


SAMPLED = {"type": "object", "properties": {
    "a": {"type": "string", "maxLength": 6}, "b": {"type": "string", "minLength": 2, "maxLength": 5},
    "c": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["a", "b", "c"], "additionalProperties": False}


def test_sampled_length_bounded_strings_are_valid_json(tiny_model_dir):
    """The issue's case: at temperature 1 the random model wrote raw C0 characters into maxLength
    strings (24 of 192 outputs of the real model); now every finished output parses and validates."""
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=512, max_model_len=256)
    prompts = random_prompts(64, (3, 8), VOCAB, seed=41)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(
        json=SAMPLED)) for i in range(len(prompts))]
    finished = [o for o in llm.generate(prompts, params) if o.finish_reason == "stop"]
    assert len(finished) >= 12
    for out in finished:
        jsonschema.validate(json.loads(out.text), SAMPLED)
