"""The quality cost of a quantized base (issue 27's target against the unquantized model), measured
in-process through the offline engine (server.engine.LLM) on the real-model evaluation's items.

For every item and model (the base, every adapter), greedy, float32 activations:
- the float engine's greedy continuation, then one teacher-forced prefill of prompt + that continuation
  through the float engine and through the quantized one, with every position's full next-token
  distribution captured (`capture_prompt_logits`): top-1 agreement (the quantized argmax equals the
  float argmax) and KL(float || quantized) in nats, per continuation position (the prompt's last one
  included: it predicts the first generated token);
- the quantized engine's own greedy replies: how many equal the float ones token for token, and each
  adapter's effect rate (benchmarks.eval.eval_checks) against float's.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from benchmarks.eval.eval_checks import EFFECTS
from benchmarks.eval.eval_http import Reply, messages
from benchmarks.eval.eval_report import score
from server.bench.eval_items import EvalItem


@contextmanager
def capture_prompt_logits(llm, keep_from: dict[tuple[int, ...], int]
                          ) -> Iterator[dict[tuple[int, ...], dict[int, torch.Tensor]]]:
    """While open, every prompt-logprob row the engine computes for a prompt in `keep_from` (prompt token
    ids -> first position kept) lands, as full-vocabulary log-probabilities [V] float32, in the yielded
    {prompt: {position: logprobs}}; position p's row predicts token p + 1. Wraps the runner's
    `prepare` (to learn each step's batch) and `forward` (to read its logits); restores both on exit."""
    runner = llm.engine.runner
    captured: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
    step: dict = {}
    prepare, forward = runner.prepare, runner.forward

    def prepare_and_remember(batch):
        step["batch"] = batch
        return prepare(batch)

    def forward_and_capture(inputs):
        logits = forward(inputs)  # [S+Q, V]
        prompt = inputs.prompt
        if prompt is not None:
            batch = step["batch"]
            offsets = [0]
            for n in batch.num_tokens:
                offsets.append(offsets[-1] + n)
            rows = logits[len(inputs.sampled_seqs):].float().log_softmax(-1)  # [Q, V]
            keys: dict[int, tuple[int, ...]] = {}
            for q, (row, i) in enumerate(zip(prompt.rows, prompt.seqs)):
                seq = batch.seqs[i]
                key = keys.setdefault(i, tuple(seq.prompt_token_ids))
                pos = seq.num_computed_tokens + row - offsets[i]
                if key in keep_from and pos >= keep_from[key]:
                    captured.setdefault(key, {})[pos] = rows[q].clone()
        return logits

    runner.prepare, runner.forward = prepare_and_remember, forward_and_capture
    try:
        yield captured
    finally:
        del runner.prepare, runner.forward  # the instance attributes go; the class's methods show again


def prompt_ids(tokenizer, item: EvalItem) -> list[int]:
    out = tokenizer.apply_chat_template(messages(item), tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def greedy(llm, prompts: list[list[int]], adapter: str | None, max_tokens: int) -> list[list[int]]:
    from server.engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), adapters=adapter)
    return [list(o.token_ids) for o in outs]


def teacher_forced(llm, sequences: list[list[int]], first_kept: list[int],
                   adapter: str | None) -> list[torch.Tensor]:
    """Per sequence: the log-probabilities [len - first, V] its positions first.. len-2 give the next token,
    from one prefill that generates nothing (prompt logprobs, max_tokens 0)."""
    from server.engine import SamplingParams

    keys = [tuple(s) for s in sequences]
    with capture_prompt_logits(llm, dict(zip(keys, first_kept))) as captured:
        llm.generate(sequences, SamplingParams(max_tokens=0, prompt_logprobs=0), adapters=adapter)
    out = []
    for key, first in zip(keys, first_kept):
        rows = captured.get(key, {})
        want = range(first, len(key) - 1)
        assert sorted(rows) == list(want), (sorted(rows), first, len(key))
        out.append(torch.stack([rows[p] for p in want]) if rows else torch.empty(0))
    return out


def kl_and_top1(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of two log-probability tables [T, V]: KL(ref || other) in nats [T] and whether
    the argmaxes agree [T] (bool)."""
    assert ref.shape == other.shape, (ref.shape, other.shape)
    kl = (ref.exp() * (ref - other)).sum(-1).clamp_min(0.0)  # [T]; rounding can make ~-1e-9
    return kl, ref.argmax(-1) == other.argmax(-1)


@dataclass
class ModelStats:
    """One model's (base or adapter's) comparison, float vs quantized, summed over items."""

    positions: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    greedy_equal: int = 0
    items: int = 0
    worst: list[tuple[float, str, int]] = field(default_factory=list)  # (KL, item id, position), largest

    def add_item(self, item_id: str, kl: torch.Tensor, agree: torch.Tensor, same_greedy: bool) -> None:
        self.items += 1
        self.greedy_equal += int(same_greedy)
        self.positions += kl.numel()
        self.top1_agree += int(agree.sum())
        self.kl_sum += float(kl.sum())
        if kl.numel():
            k, p = float(kl.max()), int(kl.argmax())
            self.kl_max = max(self.kl_max, k)
            self.worst = sorted([*self.worst, (k, item_id, p)], reverse=True)[:3]

    def summary(self) -> dict:
        return {"items": self.items, "positions": self.positions,
                "top1_agreement": round(self.top1_agree / self.positions, 5) if self.positions else None,
                "mean_kl": round(self.kl_sum / self.positions, 6) if self.positions else None,
                "max_kl": round(self.kl_max, 5),
                "greedy_equal": self.greedy_equal,
                "worst_positions": [{"kl": round(k, 4), "item": i, "position": p} for k, i, p in self.worst]}


def compare(ref_llm, quant_llm, items: list[EvalItem], models: list[str | None], *, max_tokens: int,
            chunk: int = 16, log=print) -> dict:
    """The comparison's JSON body: per model (None: the base, named "base"), the teacher-forced top-1
    agreement and mean KL, greedy agreement, and accuracy / effect rates of both sides' greedy replies.
    Both LLMs must hold the same adapters under the same names."""
    tokenizer = ref_llm.tokenizer
    prompts = [prompt_ids(tokenizer, it) for it in items]
    stats: dict[str, ModelStats] = {}
    replies: dict[str, dict[str, list[Reply]]] = {"float": {}, "quantized": {}}
    for model in models:
        name = model or "base"
        st = stats[name] = ModelStats()
        ref_out, quant_out = [], []
        for a in range(0, len(items), chunk):
            part = prompts[a:a + chunk]
            ref_gen = greedy(ref_llm, part, model, max_tokens)
            quant_gen = greedy(quant_llm, part, model, max_tokens)
            seqs = [p + g for p, g in zip(part, ref_gen)]
            first = [len(p) - 1 for p in part]
            ref_lp = teacher_forced(ref_llm, seqs, first, model)
            quant_lp = teacher_forced(quant_llm, seqs, first, model)
            for it, r, q, rg, qg in zip(items[a:a + chunk], ref_lp, quant_lp, ref_gen, quant_gen):
                kl, agree = kl_and_top1(r, q)
                st.add_item(it.id, kl, agree, rg == qg)
            ref_out += ref_gen
            quant_out += quant_gen
            log(f"  {name}: {min(a + chunk, len(items))}/{len(items)} items, top-1 "
                f"{st.top1_agree / max(1, st.positions):.4f}, mean KL {st.kl_sum / max(1, st.positions):.5f}")
        replies["float"][name] = [Reply(tokenizer.decode(g, skip_special_tokens=True), ()) for g in ref_out]
        replies["quantized"][name] = [Reply(tokenizer.decode(g, skip_special_tokens=True), ()) for g in quant_out]
    scores = {side: score(items, rs) for side, rs in replies.items()}
    per_model = {}
    for name, st in stats.items():
        row = st.summary()
        row["accuracy"] = {side: scores[side][name]["accuracy"]["all"] for side in scores}
        row["effects"] = {side: scores[side][name]["effects"] for side in scores}
        per_model[name] = row
    total = ModelStats()
    for st in stats.values():
        total.positions += st.positions
        total.top1_agree += st.top1_agree
        total.kl_sum += st.kl_sum
        total.greedy_equal += st.greedy_equal
        total.items += st.items
        total.kl_max = max(total.kl_max, st.kl_max)
    return {"per_model": per_model, "all": total.summary(),
            "replies": {side: {m: [r.text for r in rs] for m, rs in by.items()} for side, by in replies.items()}}


def effect_gaps(per_model: dict) -> dict[str, float]:
    """Per adapter (whose name is an effect): quantized minus float effect rate, in points."""
    out = {}
    for name, row in per_model.items():
        if name in EFFECTS:
            f, q = row["effects"]["float"][name], row["effects"]["quantized"][name]
            out[name] = round(100 * (q - f), 2)
    return out


def targets(doc: dict, *, top1: float = 0.95, kl: float = 0.02, effect_points: float = 3.0) -> dict:
    """Issue 27's three targets against the unquantized model, each with its number and whether met."""
    a = doc["all"]
    gaps = effect_gaps(doc["per_model"])
    return {
        "top1_agreement": {"value": a["top1_agreement"], "target": f">= {top1}", "met": a["top1_agreement"] >= top1},
        "mean_kl": {"value": a["mean_kl"], "target": f"<= {kl}", "met": a["mean_kl"] <= kl},
        "effect_rate_gap_points": {"value": gaps, "target": f"|gap| <= {effect_points}",
                                   "met": all(abs(g) <= effect_points for g in gaps.values())},
    }


def format_table(variant: str, doc: dict) -> str:
    lines = [f"{variant}: vs float32",
             f"{'model':<12} {'items':>5} {'positions':>9} {'top-1':>7} {'mean KL':>9} {'max KL':>7} "
             f"{'greedy =':>9} {'acc f/q':>11} {'effect f/q':>12}"]
    for name, row in [*doc["per_model"].items(), ("all", doc["all"])]:
        acc = row.get("accuracy")
        acc_s = f"{acc['float']:.3f}/{acc['quantized']:.3f}" if acc else ""
        eff = row.get("effects")
        eff_s = (f"{eff['float'][name]:.3f}/{eff['quantized'][name]:.3f}" if eff and name in EFFECTS else "")
        lines.append(f"{name:<12} {row['items']:>5} {row['positions']:>9} {row['top1_agreement']:>7.4f} "
                     f"{row['mean_kl']:>9.5f} {row['max_kl']:>7.3f} {row['greedy_equal']:>4}/{row['items']:<4} "
                     f"{acc_s:>11} {eff_s:>12}")
    return "\n".join(lines)
