"""Property: every structured output that finishes with `stop` is valid JSON that satisfies its
schema. Hypothesis draws schemas (types, numeric bounds, string lengths, patterns, formats, enums
and consts with awkward characters, nested objects and arrays with item bounds, required and
optional properties); the tiny random-weight model (byte-level BPE, so any byte sequence is
reachable) samples each at temperature 1, many schemas and samples in one batch, and jsonschema
checks each finished output (formats where xgrammar's are exact)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from server.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine_helpers import random_prompts

VOCAB = 512
SCHEMAS_PER_BATCH = 8
SAMPLES_PER_SCHEMA = 8
BATCHES = 40
MAX_TOKENS = 40

AWKWARD = ["a", "", "x y", 'q"t', "b\\s", "n\nl", "t\tb", "\x01", "é", "\u2028"]
PATTERNS = [r"^[a-z]{1,4}$", r"^\d{2}-\d{2}$", r"^(ab|cd)+$", r"^a\nb$", r'^"[0-9]?$', r"^\\x?$", r"^.{0,3}$"]
FORMATS = ["date", "time", "email", "ipv4", "uuid", "hostname"]
VALIDATOR = jsonschema.Draft202012Validator
# Formats asserted where xgrammar's format regex is exact; its date admits 0000-02-31 and its ipv4
# leading zeros (valid JSON strings, looser than jsonschema's checkers), so those stay annotations.
FORMAT_CHECKER = jsonschema.FormatChecker(formats=("email", "uuid"))
NAMES = ["a", "b", "id", 'k"q', "n\nl", "é"]

strings = st.one_of(
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(0, 3), st.integers(0, 5)),
    st.builds(lambda lo: {"type": "string", "minLength": lo}, st.integers(1, 3)),
    st.builds(lambda hi: {"type": "string", "maxLength": hi}, st.integers(0, 6)),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(FORMATS).map(lambda f: {"type": "string", "format": f}),
    st.just({"type": "string"}),
)
integers = st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                     st.integers(-50, 50), st.integers(0, 100)) | st.just({"type": "integer"})
numbers = st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
                    st.integers(-5, 5), st.integers(1, 10)) | st.just({"type": "number"})
leaves = st.one_of(
    strings, integers, numbers, st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(st.sampled_from(AWKWARD) | st.integers(-3, 3), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
    st.sampled_from(AWKWARD).map(lambda value: {"const": value}),
)


def _object(props: dict, required: set) -> dict:
    return {"type": "object", "properties": props, "required": sorted(required & set(props)),
            "additionalProperties": False}


def _containers(inner):
    arrays = st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                       inner, st.integers(0, 2), st.integers(0, 2))
    objects = st.builds(_object, st.dictionaries(st.sampled_from(NAMES), inner, min_size=1, max_size=3),
                        st.sets(st.sampled_from(NAMES)))
    return arrays | objects | st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)


schemas = st.recursive(leaves, _containers, max_leaves=4)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", kv_cache_blocks=2048, max_model_len=128, max_num_seqs=128)


@pytest.fixture(scope="module")
def tally():
    counts = {"schemas": 0, "outputs": 0, "stopped": 0}
    yield counts
    print(f"\nstructured property: {counts}")


# No shrinking: a failing batch is printed whole (its schemas and the output that broke one), and
# shrinking a batch of model samples would cost minutes.
@settings(max_examples=BATCHES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(schemas, min_size=SCHEMAS_PER_BATCH, max_size=SCHEMAS_PER_BATCH))
def test_every_finished_output_satisfies_its_schema(llm, tally, batch):
    prompts = random_prompts(len(batch) * SAMPLES_PER_SCHEMA, (2, 6), VOCAB, seed=len(json.dumps(batch)))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(json=batch[i // SAMPLES_PER_SCHEMA]))
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    tally["schemas"] += len(batch)
    tally["outputs"] += len(outs)
    failures = []
    for i, out in enumerate(outs):
        if out.finish_reason != "stop":
            continue
        tally["stopped"] += 1
        schema = batch[i // SAMPLES_PER_SCHEMA]
        try:
            value = json.loads(out.text)
        except ValueError as e:
            failures.append(f"{json.dumps(schema)}: {out.text!r} is not JSON: {e}")
            continue
        for error in VALIDATOR(schema, format_checker=FORMAT_CHECKER).iter_errors(value):
            failures.append(f"{json.dumps(schema)}: {out.text!r}: {error.message}")
    assert not failures, "\n".join(failures)
