"""OpenAI/vLLM sampling parameters: penalties, logit_bias, min_tokens, min_p, each against a
plain-torch reference of its definition, on random logits and end to end against a reference
decode loop over transformers + peft."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from server.engine import LLM, SamplingParams
from server.engine.sampler import (LogitsProcessors, apply_logit_bias, apply_penalties, mask_tokens, sample_rows,
                                   sampling_probs)
from server.engine.sampling_row import SamplingRow
from tests.engine_helpers import random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512


# ---- SamplingParams ----

@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=129), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_are_kept():
    bias = {7: 100, 9: -100.0}
    p = SamplingParams(n=128, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5, min_tokens=3,
                       min_p=1.0, logit_bias=bias, logprobs=20, prompt_logprobs=0)
    bias[7] = 0.0  # the caller's dict is copied
    assert p.logit_bias == {7: 100.0, 9: -100.0} and p.has_penalties
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    assert not SamplingParams().has_penalties


# ---- the modifications, on random logits ----

def random_case(seed: int, rows: int = 6, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    return logits, prompts, outputs


def reference_penalties(logits, prompts, outputs, presence, frequency, repetition):
    """The definitions, token by token."""
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in set(prompts[r]) | set(outputs[r]):
            x = float(out[r, t])
            out[r, t] = x / repetition[r] if x > 0 else x * repetition[r]
        for t, c in Counter(outputs[r]).items():
            out[r, t] -= frequency[r] * c + presence[r]
    return out


def test_penalty_functions_match_their_definitions():
    logits, prompts, outputs = random_case(1)
    n = logits.shape[0]
    presence, frequency, repetition = [0.5, -1.0, 2.0, 0.0, 1.2, -2.0], [1.5, 0.0, -0.7, 2.0, 0.3, 0.1], \
        [1.0, 2.0, 0.5, 1.3, 1e-3, 7.0]
    pairs = [(r, t) for r, o in enumerate(outputs) for t in o]
    output = (torch.tensor([r for r, _ in pairs]), torch.tensor([t for _, t in pairs]))
    prompt = (torch.tensor([r for r, p in enumerate(prompts) for _ in p]), torch.tensor([t for p in prompts for t in p]))
    expected = reference_penalties(logits, prompts, outputs, presence, frequency, repetition)
    got = logits.clone()
    apply_penalties(got, output, prompt, torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    # Without the prompt (every repetition penalty 1): presence and frequency alone, also on a row
    # that has no output yet.
    outputs[2] = []
    pairs = [(r, t) for r, o in enumerate(outputs) for t in o]
    output = (torch.tensor([r for r, _ in pairs]), torch.tensor([t for _, t in pairs]))
    got = logits.clone()
    apply_penalties(got, output, None, torch.tensor(presence), torch.tensor(frequency), torch.ones(n))
    expected = reference_penalties(logits, prompts, outputs, presence, frequency, [1.0] * n)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    empty = (torch.tensor([], dtype=torch.long),) * 2
    got = logits.clone()
    apply_penalties(got, empty, prompt, torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition))
    expected = reference_penalties(logits, prompts, [[]] * n, presence, frequency, repetition)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)

    biased = logits.clone()
    apply_logit_bias(biased, torch.tensor([0, 0, 3]), torch.tensor([4, 9, 4]), torch.tensor([1.5, -100.0, 3.0]))
    expected = logits.clone()
    expected[0, 4] += 1.5
    expected[0, 9] -= 100.0
    expected[3, 4] += 3.0
    assert torch.equal(biased, expected)
    mask_tokens(biased, torch.tensor([1, 1]), torch.tensor([2, 3]))
    assert biased[1, 2] == biased[1, 3] == float("-inf") and torch.isfinite(biased[1, 4:]).all()


def test_processors_apply_bias_then_min_tokens_then_penalties():
    logits, prompts, outputs = random_case(2)
    # Biased tokens that are also penalised, so the order shows.
    p = [
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5,
                       logit_bias={prompts[0][0]: 5.0, outputs[0][0]: -4.0}),
        SamplingParams(),  # untouched, in the same batch
        SamplingParams(repetition_penalty=0.8, max_tokens=64, min_tokens=40,
                       logit_bias={prompts[2][0]: -2.0, 2: 50.0}),
        SamplingParams(frequency_penalty=-1.0, min_tokens=2),  # min_tokens already reached
        SamplingParams(logit_bias={0: 100.0}, min_tokens=1),
        SamplingParams(repetition_penalty=3.0),
    ]
    stop_ids = (0, 2, 7)
    rows = [SamplingRow(p[r], 0, len(outputs[r]), Counter(outputs[r]), torch.tensor(prompts[r]),
                        stop_ids if len(outputs[r]) < p[r].min_tokens else ()) for r in range(len(p))]
    expected = logits.clone()
    for r, params in enumerate(p):
        for t, b in (params.logit_bias or {}).items():
            expected[r, t] += b
        if len(outputs[r]) < params.min_tokens:
            expected[r, list(stop_ids)] = float("-inf")
    expected = reference_penalties(expected, prompts, outputs, [q.presence_penalty for q in p],
                                   [q.frequency_penalty for q in p], [q.repetition_penalty for q in p])
    got = LogitsProcessors.build(rows, logits.device).apply(logits.clone())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[1], logits[1])
    greedy = [SamplingRow(SamplingParams(temperature=0.0, **_fields(q)), *row[1:]) for q, row in zip(p, rows)]
    assert sample_rows(logits, greedy, torch.Generator()).tokens == expected.argmax(dim=-1).tolist()
    assert LogitsProcessors.build([SamplingRow(SamplingParams(), 0, 0)] * 4, logits.device) is None  # fast path


def test_extreme_logits_stay_safe_under_every_modification():
    from server.engine.sampler import SampleFailure

    logits = torch.zeros(4, 32)
    logits[:, 7] = 3.3e38
    logits[:, 3] = -3.3e38
    logits[1, 5] = float("nan")  # a broken row: fails alone
    every = dict(logit_bias={7: 100.0, 3: -100.0}, repetition_penalty=1e-30, presence_penalty=-2.0,
                 frequency_penalty=-2.0, min_tokens=1, max_tokens=4, min_p=0.5)
    rows = [SamplingRow(SamplingParams(temperature=t, seed=1, logprobs=2, **every), 0, 0, Counter([7, 3]), torch.tensor([7, 3, 9]),
                        (3,)) for t in (0.0, 0.0, 1.0, 1e-5)]
    out = sample_rows(logits, rows, torch.Generator())
    assert out.tokens[0] == out.tokens[2] == out.tokens[3] == 7
    assert isinstance(out.tokens[1], SampleFailure) and out.tokens[1].non_finite and out.logprobs[1] is None
    assert out.logprobs[0].token_id == 7 and out.logprobs[0].logprob == 0.0


def _fields(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, min_tokens=p.min_tokens)


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p on one row, as vLLM defines them; normalised."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    order = torch.argsort(row, descending=True, stable=True).tolist()
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k:
        keep[order[p.top_k:]] = False
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if p.top_p < 1.0:
        kept, before = probs.clone(), 0.0
        for rank, t in enumerate(order):  # keep a token while the mass ranked above it is < top_p
            if rank > 0 and before >= p.top_p:
                kept[t] = 0.0
            before += float(probs[t])
        probs = kept
    if p.min_p:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


TRUNCATED = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=1.3, top_k=10, min_p=0.05),
             SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1), SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
             SamplingParams(temperature=2.0), SamplingParams(temperature=2.0, min_p=1.0),
             SamplingParams(temperature=0.9, top_k=5, top_p=0.5, min_p=0.3), SamplingParams(temperature=1.0, min_p=0.5),
             SamplingParams(temperature=3.0, top_p=0.99), SamplingParams(temperature=0.3, top_p=0.6),
             SamplingParams(temperature=1.0, top_k=40, top_p=0.95), SamplingParams(temperature=1.0, top_k=6)]


@pytest.mark.parametrize("candidates", [(256,), (4, 12), (8,)])  # of 64: some rows rank a few, others all
def test_temperature_top_k_top_p_min_p_match_their_definitions(candidates):
    logits, _, _ = random_case(3, rows=len(TRUNCATED), vocab=64)
    weights = sampling_probs(logits, TRUNCATED, candidates)
    got = weights / weights.sum(dim=-1, keepdim=True)
    for r, p in enumerate(TRUNCATED):
        expected = reference_probs(logits[r], p).float()
        assert torch.equal(got[r] > 0, expected > 0), r
        torch.testing.assert_close(got[r], expected, rtol=1e-4, atol=1e-6)
    assert int((got[5] > 0).sum()) == 1 and int(got[5].argmax()) == int(logits[5].argmax())


def test_draws_follow_the_truncated_distribution(monkeypatch):
    import server.engine.sampler as sampler

    monkeypatch.setattr(sampler, "CANDIDATES", (4, 12))
    logits, _, _ = random_case(4, rows=len(TRUNCATED), vocab=64)
    logits = logits / 3  # flatter: many tokens in play
    widths = sorted(g.weights.shape[1] for g in sampler.truncate(logits, TRUNCATED) if g.token_ids is not None)
    assert set(widths) == {4, 12, 64}  # every width taken: 4 and 12 candidates, and all 64 tokens
    expected = sampling_probs(logits, TRUNCATED)
    expected = expected / expected.sum(dim=-1, keepdim=True)
    draws = 4000
    rows = [SamplingRow(p, 0, 0) for p in TRUNCATED for _ in range(draws)]
    tokens = sample_rows(logits.repeat_interleave(draws, dim=0), rows, torch.Generator().manual_seed(0)).tokens
    for r in range(len(TRUNCATED)):
        counts = torch.bincount(torch.tensor(tokens[r * draws:(r + 1) * draws]), minlength=64) / draws
        assert torch.all(counts[expected[r] == 0] == 0), r
        assert float((counts - expected[r]).abs().max()) < 0.035, r
    # How many candidates a row ranks never changes what a seed draws.
    seeded = [SamplingRow(SamplingParams(**{**_truncation_fields(p), "seed": s}), 0, 0)
              for p in TRUNCATED for s in range(20)]
    wide = logits.repeat_interleave(20, dim=0)
    narrow = sample_rows(wide, seeded, torch.Generator()).tokens
    monkeypatch.setattr(sampler, "CANDIDATES", (64,))
    assert sample_rows(wide, seeded, torch.Generator()).tokens == narrow


def _truncation_fields(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)


# ---- end to end against transformers + peft ----

@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=256, max_model_len=512)
    llm.add_adapter("r8_all", tiny_adapters["r8_all"])
    return llm


@pytest.fixture(scope="module")
def reference_decode(tiny_model_dir, tiny_adapters):
    """reference_decode(adapter, prompt, max_tokens, **SamplingParams fields) -> tokens: greedy decoding
    over transformers (+ peft), the modifications written out token by token, stopping as vLLM does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}

    @torch.inference_mode()
    def decode(adapter, prompt, max_tokens, logit_bias=None, min_tokens=0, stop_token_ids=(), eos=None,
               presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0):
        if adapter not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            models[adapter] = (PeftModel.from_pretrained(model, tiny_adapters[adapter]) if adapter else model).eval()
        stops = set(stop_token_ids) | ({eos} if eos is not None else set())
        out: list[int] = []
        while len(out) < max_tokens:
            row = models[adapter](input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
            for t, b in (logit_bias or {}).items():
                row[t] += b
            if len(out) < min_tokens:
                row[list(stops)] = float("-inf")
            row = reference_penalties(row[None], [prompt], [out], [presence_penalty], [frequency_penalty],
                                      [repetition_penalty])[0]
            out.append(int(row.argmax()))
            if out[-1] in stops:
                break
        return out

    return decode


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=2.0), dict(presence_penalty=2.0),
                                     dict(frequency_penalty=1.5), dict(repetition_penalty=0.7, presence_penalty=-1.0)])
def test_penalised_greedy_matches_reference_decode(llm, reference_decode, penalty):
    prompts = random_prompts(3, (6, 14), VOCAB, seed=71)
    names = ["r8_all", None, "r8_all"]
    plain = llm.generate(prompts, greedy(max_tokens=16), adapters=names)
    outs = llm.generate(prompts, greedy(max_tokens=16, **penalty), adapters=names)
    changed = 0
    for prompt, name, base, out in zip(prompts, names, plain, outs):
        assert out.token_ids == reference_decode(name, prompt, 16, **penalty)
        changed += out.token_ids != base.token_ids
    assert changed  # the penalty mattered, so the comparison means something


def test_min_tokens_holds_back_eos_and_stop_ids(llm, reference_decode):
    eos = llm.tokenizer.eos_token_id
    prompt = random_prompts(1, (10, 10), VOCAB, seed=72)[0]
    forced = dict(logit_bias={eos: 100.0})  # EOS becomes the greedy token everywhere
    assert llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, **forced))[0].token_ids == [eos]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4, **forced))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 5 and out.token_ids[-1] == eos
    assert out.token_ids == reference_decode(None, prompt, 10, min_tokens=4, eos=eos, **forced)
    # ignore_eos: EOS is neither masked nor a stop, so the forced EOS just repeats.
    ignored = llm.generate([prompt], greedy(max_tokens=3, min_tokens=2, **forced))[0]
    assert ignored.token_ids == [eos] * 3

    first = llm.generate([prompt], greedy(max_tokens=1))[0].token_ids[0]
    out = llm.generate([prompt], greedy(max_tokens=12, min_tokens=3, stop_token_ids=[first],
                                        logit_bias={first: 3.0}))[0]
    expected = reference_decode(None, prompt, 12, min_tokens=3, stop_token_ids=[first], logit_bias={first: 3.0})
    assert out.token_ids == expected and first not in out.token_ids[:3]
    assert out.finish_reason == ("stop" if expected[-1] == first else "length")


def test_stop_strings_wait_for_min_tokens(llm):
    for prompt in random_prompts(40, (8, 8), VOCAB, seed=73):
        full = llm.generate([prompt], greedy(max_tokens=10))[0]
        head = llm.tokenizer.decode(full.token_ids[:1])
        if len(head.strip()) >= 2 and full.text.count(head) == 1 and full.text.startswith(head):
            break
    else:
        pytest.skip("no prompt whose first token's text is a unique stop string")
    assert llm.generate([prompt], greedy(max_tokens=10, stop=[head]))[0].finish_reason == "stop"
    late = llm.generate([prompt], greedy(max_tokens=10, stop=[head], min_tokens=3))[0]
    assert late.finish_reason == "length" and late.token_ids == full.token_ids and late.text == full.text


def test_negative_logit_bias_replaces_the_greedy_token(llm, reference_decode):
    prompt = random_prompts(1, (9, 9), VOCAB, seed=74)[0]
    plain = llm.generate([prompt], greedy(max_tokens=6), adapters=["r8_all"])[0].token_ids
    bias = {plain[0]: -100.0}
    out = llm.generate([prompt], greedy(max_tokens=6, logit_bias=bias), adapters=["r8_all"])[0].token_ids
    assert out[0] != plain[0] and plain[0] not in out
    assert out == reference_decode("r8_all", prompt, 6, logit_bias=bias)


def test_min_p_one_is_greedy_at_any_temperature(llm):
    prompts = random_prompts(4, (5, 12), VOCAB, seed=75)
    expected = [o.token_ids for o in llm.generate(prompts, greedy(max_tokens=10), adapters="r8_all")]
    for seed in range(3):
        hot = SamplingParams(max_tokens=10, temperature=2.5, min_p=1.0, seed=seed, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(prompts, hot, adapters="r8_all")] == expected
    unfiltered = SamplingParams(max_tokens=10, temperature=2.5, seed=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, unfiltered, adapters="r8_all")] != expected
