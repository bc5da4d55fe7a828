"""Unseeded sampling with speculative decoding keeps the target's distribution (rejection sampling).

An unseeded row's tokens cannot be the plain engine's (each draws from the engine's generator), so what
is checked is their distribution: many requests for one prompt, their first output tokens tallied, and
a chi-square test of the tallies against the exact distribution, computed here from transformers'
logits with every sampling parameter applied in plain torch (an oracle of its own, not the sampler's
code), for the plain engine and for the speculative one. The prompt repeats four tokens, which a logit
bias and top_k = 4 make the only ones the model may choose, so prompt lookup drafts at every step and
the model's own probabilities (neither near 0 nor 1) decide whether each draft is accepted: both
verification paths, accepting and rejecting, run hundreds of times. Seeds are fixed: the test is
deterministic, and a sampler that kept drafts more often than the target chooses them (or drew the
token after a rejection from the target's distribution again instead of the residual) fails it by far.
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from server.engine import LLM, SamplingParams

pytestmark = pytest.mark.unit

CHOICES = [18, 231, 408, 491]  # the four tokens a request may choose
PROMPT = [5] + CHOICES * 4
DRAWS = 3000  # requests per engine
OUTPUT = 3  # tokens tallied per request: the first by the prompt's step, the others by verify steps
MAX_TOKENS = 5  # past OUTPUT, so a verify step's drafts are not cut to the tokens left
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}

PARAMS = {
    "temperature": dict(temperature=1.0, top_k=4),
    # Every parameter that shapes a position's distribution, the penalties over the drafts before it too.
    "every parameter": dict(temperature=0.7, top_k=4, top_p=0.95, min_p=0.02, presence_penalty=0.4,
                            frequency_penalty=0.3, repetition_penalty=1.3),
}


def target_probs(logits: torch.Tensor, output: list[int], p: dict) -> torch.Tensor:
    """The next token's distribution [V] from raw logits [V], vLLM's order: logit_bias, penalties
    (repetition over prompt and output, presence and frequency over the output), temperature, top_k,
    top_p (the smallest prefix reaching it), min_p (relative to the top probability)."""
    x = logits.double().clone()
    x[CHOICES] += 30.0  # the logit bias every request carries
    seen = set(PROMPT) | set(output)
    rp = p.get("repetition_penalty", 1.0)
    for t in seen:
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    for t, n in Counter(output).items():
        x[t] -= p.get("presence_penalty", 0.0) + p.get("frequency_penalty", 0.0) * n
    probs = torch.softmax(x / p["temperature"], dim=0)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: p["top_k"]]] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    sorted_p = probs[order]
    before = sorted_p.cumsum(0) - sorted_p
    drop = before >= p.get("top_p", 1.0)
    drop[0] = False
    probs[order[drop]] = 0.0
    probs[probs < p.get("min_p", 0.0) * probs.max()] = 0.0
    return probs / probs.sum()


def exact_distribution(model_dir, p: dict) -> dict[tuple[int, ...], float]:
    """P(first OUTPUT tokens) over CHOICES^OUTPUT, from transformers' logits of every prefix."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(CHOICES, repeat=OUTPUT):
            logits = model(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1:]
            prob = 1.0
            for j, token in enumerate(seq):
                prob *= target_probs(logits[j], list(seq[:j]), p)[token].item()
            out[seq] = prob
    assert abs(sum(out.values()) - 1.0) < 1e-6, "top_k keeps only CHOICES: their sequences hold all the mass"
    return out


def chi_square_p(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> float:
    """The p-value of Pearson's chi-square test of `counts` against `expected` probabilities, cells of
    expected count under 5 pooled into one."""
    cells, pooled_e, pooled_o = [], 0.0, 0
    for seq, prob in expected.items():
        if prob * n >= 5:
            cells.append((counts[seq], prob * n))
        else:
            pooled_e += prob * n
            pooled_o += counts[seq]
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def tally(llm: LLM, p: dict) -> Counter:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={t: 30.0 for t in CHOICES}, **p)
    outs = llm.generate([PROMPT] * DRAWS, params)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    return Counter(tuple(o.token_ids[:OUTPUT]) for o in outs)


@pytest.mark.parametrize("name", list(PARAMS))
def test_unseeded_sampled_tokens_keep_the_target_distribution(tiny_model_dir, name):
    p = PARAMS[name]
    expected = exact_distribution(tiny_model_dir, p)
    # Neither near 0 nor near 1 (else acceptance or rejection would hardly run): each first token's
    # probability between 5% and 80%.
    first = Counter()
    for seq, prob in expected.items():
        first[seq[0]] += prob
    assert all(0.05 < first[t] < 0.8 for t in CHOICES), first
    opts = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=48, max_num_batched_tokens=512,
                kernels="torch")
    plain, spec = LLM(tiny_model_dir, **opts), LLM(tiny_model_dir, speculative_config=SPEC, **opts)
    plain_counts, spec_counts = tally(plain, p), tally(spec, p)
    processor = spec.engine.output_processor
    drafted, accepted = processor.num_draft_tokens, processor.num_accepted_tokens
    # Both paths ran many times: drafts accepted, and drafts rejected (the residual draw).
    assert accepted > 500 and drafted - accepted > 500, (drafted, accepted)
    assert plain.engine.output_processor.num_draft_tokens == 0
    assert chi_square_p(plain_counts, expected, DRAWS) > 1e-3, "the oracle disagrees with the plain engine"
    assert chi_square_p(spec_counts, expected, DRAWS) > 1e-3, (spec_counts.most_common(8), drafted, accepted)
