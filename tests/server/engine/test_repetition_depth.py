"""Nested unbounded repetition in a user grammar or regex is refused at compile, naming the
constraint, before any token is generated; ordinary grammars, regexes and JSON schemas are not."""
from __future__ import annotations

import pytest

from benchmarks.security.nested_constraints import nested_grammar, nested_regex
from server.engine import LLM, RequestError, SamplingParams, StructuredOutputsParams
from server.engine.repetition_depth import MAX_NESTED_REPETITION, grammar_depth, regex_depth
from tests.server.engine.test_engine_structured import EBNF, REGEX, SCHEMA


@pytest.mark.parametrize(("text", "depth"), [
    (EBNF, 1),
    ('root ::= (line "\\n")*\nline ::= (word " ")*\nword ::= [a-z]+', 3),
    ('root ::= value\nvalue ::= obj | [0-9]+\nobj ::= "{" (value ("," value)*)? "}"', 1),  # recursion adds nothing
    ('root ::= ("a"{2,} "b"{1,3})*  # a comment (with a paren', 2),
    ('root ::= "(*)*" [*+]', 0),  # quantifiers inside literals are text
    (nested_grammar(40), 40),
])
def test_grammar_depth(text, depth):
    assert grammar_depth(text) == depth


@pytest.mark.parametrize(("pattern", "depth"), [
    (REGEX, 0), (r"(\w+\s*)*", 2), (r"(a{2,})+?", 2), (r"\(\*\)", 0), (nested_regex(40), 40),
    ("(" * 40 + "[a-z]" + ")*" * 40, 40), ("(unclosed", 0),
])
def test_regex_depth(pattern, depth):
    assert regex_depth(pattern) == depth


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", kv_cache_blocks=64, max_model_len=256)


@pytest.mark.parametrize(("kind", "value"), [("grammar", nested_grammar(40)), ("regex", nested_regex(40)),
                                             ("grammar", nested_grammar(MAX_NESTED_REPETITION + 1))])
def test_nested_repetition_is_refused_at_compile(llm, kind, value):
    with pytest.raises(RequestError, match=f"invalid {kind} constraint: unbounded repetitions .* nested"):
        llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**{kind: value})))
    assert llm.engine.stats().num_running == 0


@pytest.mark.parametrize(("kind", "value"), [("grammar", nested_grammar(MAX_NESTED_REPETITION)),
                                             ("regex", nested_regex(MAX_NESTED_REPETITION)), ("json", SCHEMA)])
def test_shallower_constraints_compile(llm, kind, value):
    out, = llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**{kind: value})))
    assert out.finish_reason in ("stop", "length")
