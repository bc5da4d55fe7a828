"""The real-model evaluation's numbers: accuracy per model and kind, each demo adapter's effect rate,
and per-item agreement between the HTTP replies and the transformers + peft oracle's (a reply agrees
when its generated tokens are the same), with the first diverging token of every mismatch."""
from __future__ import annotations

from benchmarks.eval.eval_checks import EFFECTS, has_effect, is_correct
from benchmarks.eval.eval_http import Reply
from server.bench.eval_items import EvalItem


def score(items: list[EvalItem], replies: dict[str, list[Reply]]) -> dict:
    """model -> {"accuracy": {kind: rate, "all": rate}, "effects": {effect: rate over the effect items}}."""
    out = {}
    kinds = sorted({i.kind for i in items})
    effect_idx = [n for n, i in enumerate(items) if i.effect]
    for model, rs in replies.items():
        right = [is_correct(i, r.text) for i, r in zip(items, rs)]
        accuracy = {k: _rate([ok for ok, i in zip(right, items) if i.kind == k]) for k in kinds}
        accuracy["all"] = _rate(right)
        effects = {e: _rate([has_effect(e, rs[n].text) for n in effect_idx]) for e in EFFECTS}
        out[model] = {"accuracy": accuracy, "effects": effects}
    return out


def _rate(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def first_divergence(a: tuple[str, ...], b: tuple[str, ...]) -> int | None:
    """The first index where two token lists differ (one ending early counts), or None if equal."""
    for n, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return n
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(items: list[EvalItem], http: dict[str, list[Reply]], oracle: dict[str, list[Reply]]) -> dict:
    """{"per_model": {model: rate}, "all": rate, "mismatches": [...]} (each mismatch: the item, the model,
    the token index, both tokens, the HTTP side's top-2 logprobs there, both replies)."""
    per_model, mismatches, flags = {}, [], []
    for model, rs in http.items():
        same = []
        for item, h, o in zip(items, rs, oracle[model]):
            n = first_divergence(h.tokens, o.tokens)
            same.append(n is None and h.prompt_tokens == o.prompt_tokens)
            if n is not None or h.prompt_tokens != o.prompt_tokens:
                mismatches.append({
                    "item": item.id, "model": model, "token_index": n,
                    "http_token": h.tokens[n] if n is not None and n < len(h.tokens) else None,
                    "peft_token": o.tokens[n] if n is not None and n < len(o.tokens) else None,
                    "http_top_logprobs": list(h.top2[n]) if n is not None and n < len(h.top2) else None,
                    "prompt_tokens": [h.prompt_tokens, o.prompt_tokens], "http": h.text, "peft": o.text})
        per_model[model] = _rate(same)
        flags += same
    return {"per_model": per_model, "all": _rate(flags), "mismatches": mismatches}


def format_table(scores: dict, agree: dict) -> str:
    """One row per model: accuracy by kind, the effect rates and the HTTP/PEFT agreement."""
    models = list(scores)
    kinds = [k for k in next(iter(scores.values()))["accuracy"] if k != "all"]
    head = ["model", *kinds, "all", *(f"{e}%" for e in EFFECTS), "agree"]
    rows = [head]
    for m in models:
        acc, eff = scores[m]["accuracy"], scores[m]["effects"]
        rows.append([m, *(f"{acc[k]:.2f}" for k in kinds), f"{acc['all']:.2f}",
                     *(f"{100 * eff[e]:.0f}" for e in EFFECTS), f"{100 * agree['per_model'][m]:.1f}%"])
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows)
