"""Structured output with speculative decoding: constrained choices take drafts, each verify position
masked as the plain engine masks it, so outputs stay valid and the plain engine's, token for token.

A constrained choice's drafts are checked by its grammar when its masks are filled, off the step
(server.engine.mask_lane): the drafts it refuses are never run, and one mask row is filled per draft it
accepts. The constraints here repeat themselves (a regex of repeated words, JSON arrays of one enum, a
grammar of repeated items), so prompt lookup finds drafts in the output itself and the model, under the
mask, often agrees with them: drafts are accepted, and others are refused by the grammar or rejected by
the model. A draft model's drafts are made in the step and checked there, on a fork of the matcher.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from server.engine import LLM, SamplingParams, StructuredOutputsParams, mask_lane
from server.engine.grammar import Grammars
from tests.engine_helpers import random_prompts
from tests.server.engine.test_engine_mask_lane import _Delayed
from tests.server.engine.test_speculative_medusa import random_heads
from tests.server.engine.test_speculative_ngram import assert_same

pytestmark = pytest.mark.unit

VOCAB = 512
REGEX = r"(la |li ){2,12}end"
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                     "minItems": 2, "maxItems": 6}},
          "required": ["items"], "additionalProperties": False}
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= "xy" | "z"'
SPECS = {
    "regex": StructuredOutputsParams(regex=REGEX),
    "json": StructuredOutputsParams(json=SCHEMA),
    "grammar": StructuredOutputsParams(grammar=EBNF),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 64}


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return re.fullmatch(r"\((?:xy|z)(?:,(?:xy|z))*\)", text) is not None


def engines(model_dir, adapters, spec: dict) -> tuple[LLM, LLM]:
    opts = dict(device="cpu", dtype="float32", max_loras=2, max_model_len=256, kv_cache_blocks=256,
                kernels="torch")
    llms = LLM(model_dir, **opts), LLM(model_dir, speculative_config=spec, **opts)
    for llm in llms:
        llm.add_adapter("a", adapters["r8_all"])
    return llms


def batch(kind: str) -> tuple[list, list, list]:
    """Constrained choices, greedy and seeded (one with penalties), base and adapter, beside two
    unconstrained rows."""
    prompts = random_prompts(6, (5, 20), VOCAB, seed=41)
    so = SPECS[kind]
    params = [SamplingParams(max_tokens=100, temperature=0.0, structured_outputs=so),
              SamplingParams(max_tokens=100, temperature=0.0, structured_outputs=so),
              SamplingParams(max_tokens=100, temperature=0.9, seed=11, structured_outputs=so),
              SamplingParams(max_tokens=100, temperature=0.7, seed=5, presence_penalty=0.3, structured_outputs=so,
                             logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=2, ignore_eos=True)]
    return prompts, params, [None, "a", None, "a", "a", None]


def every_kind() -> tuple[list, list, list]:
    """The constrained choices of batch(kind) for every kind, in one batch."""
    prompts, params, names = [], [], []
    for kind in SPECS:
        p, ps, ns = batch(kind)
        prompts += p[:4]
        params += ps[:4]
        names += ns[:4]
    return prompts, params, names


def method_spec(method: str, model_dir) -> dict:
    """ngram, or a draft model (the target as its own: its greedy first draft, made under the choice's
    mask, is often the choice, its later ones often refused by the grammar)."""
    return NGRAM if method == "ngram" else {**DRAFT, "model": str(model_dir)}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_choices_speculate_and_match_the_plain_engine(tiny_model_dir, tiny_adapters, kind, method):
    """A draft model's drafts are made inside the step and checked by the grammar there, on a fork of the
    matcher, while the step runs; ngram's off the step, when the masks are filled."""
    plain, spec = engines(tiny_model_dir, tiny_adapters, method_spec(method, tiny_model_dir))
    prompts, params, names = batch(kind)
    outs = [llm.generate(prompts, params, adapters=names) for llm in (plain, spec)]
    assert_same(*outs)
    for out in outs[1][:4]:
        if out.finish_reason == "stop":
            assert valid(kind, out.text), out.text
    assert sum(out.finish_reason == "stop" for out in outs[1][:4]) >= 2
    # The constrained choices alone: their drafts were verified and some accepted.
    plain_c, spec_c = engines(tiny_model_dir, tiny_adapters, method_spec(method, tiny_model_dir))
    outs = [llm.generate(prompts[:4], params[:4], adapters=names[:4]) for llm in (plain_c, spec_c)]
    assert_same(*outs)
    processor = spec_c.engine.output_processor
    assert processor.num_accepted_tokens > 0, "no constrained draft was accepted: the test shows nothing"
    assert processor.num_draft_tokens > processor.num_accepted_tokens


def test_unseeded_constrained_choices_speculate_and_stay_valid(tiny_model_dir, tiny_adapters):
    _, spec = engines(tiny_model_dir, tiny_adapters, NGRAM)
    prompts = random_prompts(8, (5, 20), VOCAB, seed=43)
    outs = spec.generate(prompts, SamplingParams(max_tokens=100, temperature=1.0, structured_outputs=SPECS["regex"]))
    stopped = [out for out in outs if out.finish_reason == "stop"]
    assert len(stopped) >= 4 and all(valid("regex", out.text) for out in stopped)
    assert spec.engine.output_processor.num_accepted_tokens > 0


def test_a_fill_checks_the_drafts_and_fills_a_row_after_each_it_accepts(tiny_model_dir):
    """The lane's fill for drafts: it keeps the drafts up to the first the grammar refuses, fills the row
    after each kept one as a matcher advanced by them fills it, and leaves the matcher where it was."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id])
    spec = StructuredOutputsParams(choice=["alpha beta gamma delta"])
    compiled = grammars.compile(spec)
    text = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    assert len(text) >= 4
    lane = grammars.choice_matcher(compiled, "choice", None, max_drafts=4)
    while not lane.ready:
        pass
    assert lane.accept_token(text[0])
    wrong = next(t for t in range(3, VOCAB) if t != text[3])
    lane.refill([text[1], text[2], wrong, text[3]])
    while not lane.ready:
        pass
    assert lane.drafts == [text[1], text[2]]  # the grammar refused the third: nothing past it is verified
    reference = xgr.GrammarMatcher(compiled)
    assert reference.accept_token(text[0])
    for j in range(3):  # rows 0..2: after text[0], then after each kept draft
        want = xgr.allocate_token_bitmask(1, grammars.info.vocab_size)
        reference.fill_next_token_bitmask(want)
        assert lane.position(j).row().equal(want), j
        if j < 2:
            assert reference.accept_token(text[1 + j])
    # Rolled back: the emitted tokens are accepted from where the step started.
    assert lane.accept_token(text[1]) and lane.accept_token(text[2])
    lane.refill([])
    while not lane.ready:
        pass
    assert lane.drafts == [] and lane.row().equal(want)
    grammars.lane.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_outputs_match_whatever_the_fills_timing(tiny_model_dir, tiny_adapters, method):
    """Fills delayed at random: choices sit out steps, their drafts and masks late; a draft model's checks
    finish after the step's sampling, which then verifies none of that choice's drafts (and reads no row
    the check may still be writing). The plain engine's tokens still."""
    plain, spec = engines(tiny_model_dir, tiny_adapters, method_spec(method, tiny_model_dir))
    rng = random.Random(3)
    lane = spec.engine.grammars.lane
    lane.pool = _Delayed(lane.pool, lambda: rng.choice([0, 0, 0.002, 0.02, 0.05]))
    prompts, params, names = every_kind()
    outs = [llm.generate(prompts, params, adapters=names) for llm in (plain, spec)]
    assert_same(*outs)
    assert spec.engine.output_processor.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_medusa_drafts_for_constrained_choices(tiny_model_dir, tiny_adapters, tmp_path, kind):
    heads = random_heads(tmp_path / "heads")
    spec = {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3}
    plain, medusa = engines(tiny_model_dir, tiny_adapters, spec)
    prompts, params, names = batch(kind)
    outs = [llm.generate(prompts, params, adapters=names) for llm in (plain, medusa)]
    assert_same(*outs)
    assert medusa.engine.output_processor.num_draft_tokens > 0


def test_a_costly_fork_ends_drafting_for_its_choice(tiny_model_dir, tiny_adapters, monkeypatch):
    """The fork a draft model's check starts from is made on the engine thread: past MAX_FORK_SECONDS
    (here every fork is) its choice drafts no more, and decodes as the plain engine does."""
    monkeypatch.setattr(mask_lane, "MAX_FORK_SECONDS", -1.0)
    plain, drafted = engines(tiny_model_dir, tiny_adapters, method_spec("draft_model", tiny_model_dir))
    prompts, params, names = batch("json")
    outs = [llm.generate(prompts[:4], params[:4], adapters=names[:4]) for llm in (plain, drafted)]
    assert_same(*outs)
    processor = drafted.engine.output_processor
    assert 0 < processor.num_draft_tokens <= 4 * DRAFT["num_speculative_tokens"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_for_n_choices_speculate_per_choice(tiny_model_dir, tiny_adapters, method):
    """n > 1: the choices fork after the prompt, each with its own matcher (and its own checks), then each
    speculates on its own: the plain engine's outputs, every choice's."""
    plain, spec = engines(tiny_model_dir, tiny_adapters, method_spec(method, tiny_model_dir))
    prompts = random_prompts(3, (5, 20), VOCAB, seed=7)
    params = [SamplingParams(n=2, max_tokens=60, temperature=0.8, seed=3, structured_outputs=SPECS["json"]),
              SamplingParams(n=3, max_tokens=60, temperature=0.0, structured_outputs=SPECS["regex"]),
              SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=SPECS["grammar"])]
    outs = [[c for o in llm.generate(prompts, params, adapters=[None, "a", "a"]) for c in o.outputs]
            for llm in (plain, spec)]
    assert [c.index for c in outs[1]] == [0, 1, 0, 1, 2, 0]
    assert_same(*outs)
    for c in outs[1]:
        if c.finish_reason == "stop":
            assert any(valid(kind, c.text) for kind in SPECS), c.text
    assert spec.engine.output_processor.num_accepted_tokens > 0
