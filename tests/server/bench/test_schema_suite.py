"""The structured-output schema suite (server/bench/schemas/): the committed files are what the seeded
generator makes, it covers the keywords the issue names, every schema compiles with xgrammar through
the engine's grammar cache, and random walks through a sample of the compiled grammars (any allowed
token, like a random model under the mask) end in JSON that jsonschema accepts, formats checked."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from server.bench.schema_suite import GENERATED, SUITE_DIR, dump, generate_schemas, load_suite
from server.engine import StructuredOutputsParams
from server.engine.grammar import Grammars

pytestmark = pytest.mark.unit

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
WALK_SAMPLE = 6  # every 6th schema is walked (all of them take a minute on 2 cores)


def _keywords(node, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        found.update(node)
        for value in node.values():
            _keywords(value, found)
    elif isinstance(node, list):
        for value in node:
            _keywords(value, found)
    return found


@pytest.fixture(scope="module")
def suite():
    return load_suite()


@pytest.fixture(scope="module")
def grammars(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.eos_token_id is not None
    return tok, Grammars(tok, 512, [tok.eos_token_id], max_entries=1024)


def test_suite_is_committed_from_its_generator(suite):
    generated = sorted((SUITE_DIR / GENERATED).glob("*.json"))
    expected = generate_schemas()
    assert [p.read_text() for p in generated] == [dump(s) for s in expected]
    assert len(suite) >= 200 and len(suite) == len(expected) + len([n for n, _ in suite if n.startswith("core/")])


def test_suite_covers_the_keywords_asked_for(suite):
    found = _keywords([s for _, s in suite], set())
    assert {"properties", "required", "items", "minItems", "maxItems", "enum", "anyOf", "format", "pattern",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const", "$ref", "$defs"} <= found
    formats = {s for _, sch in suite for s in json.dumps(sch).split('"format": "')[1:]}
    assert len({f.split('"')[0] for f in formats}) >= 5
    nested = [n for n, s in suite if '"properties"' in json.dumps(s.get("properties", {}))]
    optional = [n for n, s in suite if s.get("type") == "object" and set(s["properties"]) - set(s.get("required", []))]
    assert len(nested) >= 20 and len(optional) >= 20


def test_every_schema_compiles(suite, grammars):
    _, cache = grammars
    for name, schema in suite:
        assert cache.compile(StructuredOutputsParams(json=schema)) is not None, name
    assert cache.stats().compiles == len({json.dumps(s, sort_keys=True) for _, s in suite})


def _walk(matcher: xgr.GrammarMatcher, rng: random.Random, eos: int, steps: int = 600) -> list[int] | None:
    """Token ids of a random path through the grammar to its end, or None if it had not ended in `steps`."""
    bitmask = xgr.allocate_token_bitmask(1, 512)
    shifts = torch.arange(32, dtype=torch.int32)
    ids = []
    for _ in range(steps):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = ((bitmask[0].unsqueeze(1) >> shifts) & 1).flatten()[:512].nonzero().flatten().tolist()
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            assert matcher.accept_token(eos)
            return ids
        token = rng.choice([t for t in allowed if t != eos])
        assert matcher.accept_token(token)
        ids.append(token)
    return None


def test_random_walks_end_in_valid_json(suite, grammars):
    tok, cache = grammars
    completed = 0
    for name, schema in suite[::WALK_SAMPLE]:
        compiled = cache.compile(StructuredOutputsParams(json=schema))
        for seed in range(2):
            ids = _walk(xgr.GrammarMatcher(compiled), random.Random(seed), tok.eos_token_id)
            if ids is None:
                continue
            completed += 1
            jsonschema.validate(json.loads(tok.decode(ids)), schema, format_checker=FORMAT_CHECKER)
    assert completed >= len(suite[::WALK_SAMPLE])  # most walks end; every one that ends is valid
