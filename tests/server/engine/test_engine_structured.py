"""Structured output in the engine: every constraint form, mixed with unconstrained requests and
adapters in one batch; the tiny random model writes gibberish, but under a grammar it is valid."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from server.engine import LLM, RequestError, SamplingParams, StructuredOutputsParams
from tests.engine_helpers import random_prompts

VOCAB = 512
SCHEMA = {
    "type": "object",
    "properties": {
        # Not maxLength: xgrammar 0.2.8 compiles a bounded string without the control-character
        # exclusion JSON requires, so gibberish with raw \x10 passed; a pattern has no such hole.
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ("yes", "no", 'say "maybe"')
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'


def check(kind: str, text: str) -> None:
    """Raises unless `text` satisfies the constraint of `kind`."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\((?:[0-9x])(?:,[0-9x])*\)", text), text


SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=list(CHOICES)),
    "grammar": StructuredOutputsParams(grammar=EBNF),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=512, max_model_len=512)
    llm.add_adapter("a", tiny_adapters["r8_all"])
    return llm


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_constraint_form_gives_valid_output(llm, kind):
    prompts = random_prompts(4, (5, 20), VOCAB, seed=31)
    params = [SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=SPECS[kind]),
              SamplingParams(max_tokens=200, temperature=1.0, seed=7, n=3, structured_outputs=SPECS[kind]),
              SamplingParams(max_tokens=200, temperature=0.8, top_p=0.9, repetition_penalty=1.3,
                             presence_penalty=0.5, structured_outputs=SPECS[kind]),
              SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True, structured_outputs=SPECS[kind])]
    outs = llm.generate(prompts, params, adapters=[None, "a", "a", None])
    stopped = 0
    for out in outs:
        for choice in out.outputs:
            assert choice.finish_reason in ("stop", "length")
            if choice.finish_reason == "stop":
                check(kind, choice.text)
                stopped += 1
    assert stopped >= 4  # most choices complete their grammar well within 200 tokens


def test_unconstrained_outputs_unchanged_by_constrained_neighbours(llm):
    prompts = random_prompts(6, (4, 24), VOCAB, seed=32)
    plain = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=20, temperature=0.7, seed=6, n=2, repetition_penalty=1.2)]
    adapters = [None, "a", "a"]
    alone = llm.generate(prompts[:3], plain, adapters=adapters)
    constrained = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=SPECS["json"]),
                   SamplingParams(max_tokens=30, temperature=1.0, seed=9, structured_outputs=SPECS["regex"]),
                   SamplingParams(max_tokens=30, temperature=0.0, n=2, structured_outputs=SPECS["choice"])]
    mixed = llm.generate([prompts[0], prompts[3], prompts[1], prompts[4], prompts[2], prompts[5]],
                         [plain[0], constrained[0], plain[1], constrained[1], plain[2], constrained[2]],
                         adapters=[None, None, "a", "a", "a", None])
    # Tokens and text exactly; logprobs to float32 rounding (a batch of another size may sum in
    # another order, constrained or not).
    for a, m in zip(alone, [mixed[0], mixed[2], mixed[4]]):
        for x, y in zip(a.outputs, m.outputs):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            for u, v in zip(x.logprobs or (), y.logprobs or ()):
                assert u.token_id == v.token_id and u.logprob == pytest.approx(v.logprob, abs=1e-4)
    assert mixed[1].finish_reason == "length" or json.loads(mixed[1].text) is not None


def test_logprobs_report_the_raw_distribution(llm):
    """Under a constraint, logprobs are the model's own (unmasked) distribution, as vLLM's default:
    the same numbers an unconstrained scoring of the same tokens gives."""
    prompt = random_prompts(1, (8, 8), VOCAB, seed=33)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=5,
                                                structured_outputs=SPECS["regex"]), adapters=["a"])[0]
    scored = llm.generate([prompt + out.token_ids], SamplingParams(max_tokens=0, prompt_logprobs=5),
                          adapters=["a"])[0]
    raw = scored.prompt_logprobs[len(prompt):]
    assert len(raw) == len(out.token_ids)
    masked_elsewhere = 0
    for got, want in zip(out.logprobs, raw):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        masked_elsewhere += got.top[0][0] != got.token_id  # the grammar chose another than the argmax
    assert masked_elsewhere > 0


def test_max_tokens_cuts_a_json_output_with_length(llm):
    prompt = random_prompts(1, (6, 6), VOCAB, seed=34)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0,
                                                structured_outputs=SPECS["json"]))[0]
    assert out.finish_reason == "length"
    assert out.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_constrained_outputs_survive_preemption(tiny_model_dir):
    prompts = random_prompts(6, (20, 30), VOCAB, seed=35)
    long_regex = StructuredOutputsParams(regex=r"[a-z]{40,60}")  # runs long enough to fill the pool
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=long_regex)
              for i in range(6)]
    roomy = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=128, max_model_len=128)
    tight = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=12, max_model_len=128)
    expected = [(o.token_ids, o.finish_reason) for o in roomy.generate(prompts, params)]
    got = [(o.token_ids, o.finish_reason) for o in tight.generate(prompts, params)]
    assert tight.engine.stats().scheduler.preemptions > 0
    assert got == expected


def test_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="only use one kind"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(RequestError, match="invalid regex"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    with pytest.raises(RequestError, match="invalid grammar"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= ")))
    # accepted by xgrammar 0.2.8 but not enforced: refused rather than ignored
    unique = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}}}
    with pytest.raises(RequestError, match="uniqueItems is not supported"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(json=unique)))
    both = {"allOf": [{"type": "object"}, {"required": ["a"]}]}
    with pytest.raises(RequestError, match="allOf with more than one schema"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(json=both)))


def test_compiled_grammars_are_cached_by_canonical_schema(llm):
    before = llm.engine.stats()
    reordered = json.loads(json.dumps(SCHEMA, sort_keys=True))
    spec = StructuredOutputsParams(json=json.dumps(dict(reversed(list(reordered.items()))), indent=2))
    assert spec.key == SPECS["json"].key
    llm.generate(["hi", "ho"], SamplingParams(max_tokens=4, structured_outputs=spec))
    llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=SPECS["json"]))
    after = llm.engine.stats()
    assert after.grammar.cache_hits >= before.grammar.cache_hits + 2
    assert after.constrained_requests == before.constrained_requests + 3


def test_padded_lm_head_rows_are_never_chosen(tmp_path, tiny_model_dir):
    """A model whose lm_head has more rows than the tokenizer has tokens (vocabularies padded to a
    multiple of 64): the grammar's mask covers the extra rows and never allows them, even where
    their logits are the largest."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    padded = tmp_path / "padded"
    shutil.copytree(tiny_model_dir, padded)
    weights = load_file(padded / "model.safetensors")
    extra = 64
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        w = weights[name]
        # The padding rows point along the hidden states' typical direction, scaled up: they win the argmax.
        weights[name] = torch.cat([w, w[:extra] * 50.0]).contiguous()
    save_file(weights, padded / "model.safetensors")
    config = json.loads((padded / "config.json").read_text())
    config["vocab_size"] += extra
    (padded / "config.json").write_text(json.dumps(config))
    llm = LLM(padded, device="cpu", kv_cache_blocks=64, max_model_len=256)
    prompt = random_prompts(1, (8, 8), VOCAB, seed=36)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert any(t >= VOCAB for t in free.token_ids)  # unconstrained, the padding rows do win
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0,
                                                structured_outputs=SPECS["grammar"]))[0]
    assert all(t < VOCAB for t in out.token_ids)
    if out.finish_reason == "stop":
        check("grammar", out.text)


def test_min_tokens_yields_to_a_grammar_that_can_only_end(llm):
    """vLLM's rule (vllm#54218): min_tokens holds stop tokens back only while the grammar allows
    something else; a grammar that can only end ends (finish_reason stop), short of min_tokens,
    instead of leaving the row no token. A grammar that may go on is held to min_tokens as usual."""
    prompts = random_prompts(2, (5, 20), VOCAB, seed=34)
    done = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=12,
                          structured_outputs=StructuredOutputsParams(choice=["yes"]))
    more = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=12,
                          structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    short, held = llm.generate(prompts, [done, more], adapters=[None, "a"])
    assert short.finish_reason == "stop" and short.text == "yes" and len(short.token_ids) < 12
    assert held.finish_reason in ("stop", "length") and re.fullmatch("[a-z ]+", held.text)
    assert len(held.token_ids) >= 12
