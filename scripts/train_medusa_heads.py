"""Train Medusa heads (speculative method `medusa`, server.engine.medusa_heads) by self-distillation on the
served model: the model answers prompts (greedy, in loraplex), and head i learns to guess, from the last
layer's output at each answer position, the token i + 2 places on: what the model itself goes on to say.

train_medusa_heads.py --model DIR --out DIR [--adapter PEFT_DIR] [--num-heads 4] [--steps N]

With --adapter, the answers and the hidden states are the adapted model's (PEFT on transformers for the
hidden states), so the heads learn that adapter's continuations: upload them with it (its `medusa/` part).
Prompts: the chat instructions this script writes (topics x phrasings, none of them an evaluation item),
or --prompts FILE (one per line), rendered with the tokenizer's chat template. Only the heads train (a
residual block each, zero at the start, so each head starts as the model's own next-token guess); the
final norm and lm_head stay the model's. Writes OUT/medusa_config.json, OUT/medusa_heads.safetensors
(float16, with the draft vocabulary: the --draft-vocab ids the answers use most, which the heads draft
among) and OUT/train_log.json (loss per step, each head's top-1 accuracy on held-out answers, over the
draft vocabulary). --add-draft-vocab adds a draft vocabulary to heads already in OUT, trained on the same
prompts and --max-tokens, without training.
Deterministic for a given --seed; minutes on a CPU for SmolLM2-135M.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from server.engine import LLM, SamplingParams
from adapters.medusa_format import HeadWeights, read_heads_dir, save_heads

# Draft vocabulary ids by default: a sixth of SmolLM2's 49152, so each drafted head reads a sixth of the lm_head.
DRAFT_VOCAB_SIZE = 8192

TOPICS = ["the moon", "volcanoes", "bread", "bicycles", "the ocean", "honey bees", "rainbows", "libraries",
          "trains", "chess", "coffee", "winter", "the internet", "forests", "music", "electricity", "dinosaurs",
          "gardening", "friendship", "clouds", "the desert", "penguins", "recycling", "the human heart",
          "mountains", "rivers", "computers", "cooking pasta", "sleep", "birthdays", "the stars", "a lighthouse"]
PHRASINGS = ["Explain {t} in a few sentences.", "Write a short story about {t}.", "Give me three facts about {t}.",
             "Describe {t} to a child.", "Why is {t} interesting?", "Write a short poem about {t}.",
             "What should I know about {t}?", "Tell me something surprising about {t}."]


# Short questions and instructions, like chat traffic's (a capital, a sum, a colour, a format to keep), over
# countries, numbers and words that no evaluation item uses: heads trained only on essays guess a short
# answer's next tokens badly (2.9% of drafts accepted on the chat eval items).
COUNTRIES = ["Ecuador", "Bolivia", "Venezuela", "Uruguay", "Paraguay", "Pakistan", "Bangladesh", "Nepal", "Malaysia",
             "Jamaica", "Ghana", "Ethiopia", "Tanzania", "Senegal", "Algeria", "Tunisia", "Iraq", "Jordan", "Lebanon",
             "Romania", "Bulgaria", "Serbia", "Croatia", "Slovakia", "Estonia", "Latvia", "Lithuania", "Georgia",
             "Armenia", "Mongolia", "Cambodia", "Sri Lanka", "New Zealand", "Luxembourg", "Malta", "Albania",
             "Zambia", "Uganda", "Costa Rica", "Panama", "Honduras", "Guatemala", "Nicaragua", "El Salvador",
             "Haiti", "Bahamas", "Barbados", "Namibia", "Botswana", "Zimbabwe", "Mozambique", "Madagascar", "Angola",
             "Cameroon", "Mali", "Niger", "Chad", "Sudan", "Libya", "Rwanda", "Somalia", "Syria", "Israel", "Kuwait",
             "Qatar", "Oman", "Yemen", "Afghanistan", "Kazakhstan", "Uzbekistan", "Laos", "Myanmar", "Bhutan",
             "Singapore", "Fiji", "Samoa", "Slovenia", "Bosnia", "Montenegro", "Moldova", "Belarus", "Cyprus",
             "Wales", "Monaco", "Andorra", "Liechtenstein", "San Marino", "Taiwan", "Saudi Arabia", "Azerbaijan"]
COUNTRY_QUESTIONS = ["What is the capital of {c}?", "Tell me the capital city of {c}.", "What language is spoken in {c}?",
                     "Answer with a single word. What is the capital of {c}?", "Which continent is {c} in?",
                     'Reply in JSON with one key, "answer". What is the capital of {c}?']
THINGS = {"a lemon": "yellow", "a strawberry": "red", "a pumpkin": "orange", "milk": "white", "a leaf": "green",
          "an eggplant": "purple", "a cherry": "red", "a pear": "green", "ink": "black", "a flamingo": "pink",
          "the ocean": "blue", "a walnut": "brown"}
ANIMALS = ["chicken", "cow", "duck", "bee", "crab", "frog", "elephant", "monkey", "kangaroo", "beetle", "mouse",
           "deer", "wolf", "rabbit", "tiger", "octopus"]
WORDS = ["table", "mountain", "coffee", "silver", "forest", "rocket", "basket", "candle", "bridge", "tiger", "violin",
         "marble"]
KINDS = ["instruments", "languages", "rivers", "oceans", "trees", "insects", "drinks", "shapes", "jobs", "desserts"]


def default_prompts() -> list[str]:
    """Essays on topics, then short chat questions (none of them an evaluation item)."""
    return [p.format(t=t) for t in TOPICS for p in PHRASINGS] + short_prompts()


def short_prompts() -> list[str]:
    """Short chat questions and instructions (--short-only: what the default model's packaged heads trained on)."""
    prompts = [q.format(c=c) for c in COUNTRIES for q in COUNTRY_QUESTIONS]
    for thing, colour in THINGS.items():
        prompts += [f"What color is {thing}?", f"Is {thing} {colour}? Say what color it is."]
    for animal in ANIMALS:
        prompts += [f"How many legs does a {animal} have?", f"Tell me how many legs a {animal} has."]
    prompts += [f"Write the word '{w}' in capital letters." for w in WORDS]
    prompts += [f"List three {k}, separated by commas." for k in KINDS]
    forms = ["Compute {a} + {b}.", "What is {a} minus {b}?", "What is {a} plus {b}?", "Compute {a} - {b}.",
             "Reply with only the number, nothing else. What is {a} plus {b}?"]
    for i in range(160):  # sums and differences of numbers past the evaluation's (1 to 40)
        a, b = 41 + (i * 17) % 58, 41 + (i * 29 + i // 58) % 58
        prompts.append(forms[i % len(forms)].format(a=max(a, b), b=min(a, b)))
    return prompts


def chat_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                               add_generation_prompt=True, return_dict=True)["input_ids"])
            for p in prompts]


def generate(model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The model's own greedy answers (loraplex, batched), each as prompt + answer token ids."""
    llm = LLM(model_dir, device="cpu", dtype="float32", kernels="torch", max_model_len=1024)
    name = "tuned" if adapter is not None else None
    if adapter is not None:
        llm.add_adapter(name, adapter)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                        adapters=[name] * len(prompts) if name else None)
    llm.engine.shutdown()
    return [p + list(o.token_ids) for p, o in zip(prompts, outs)]


def hidden_states(model_dir: Path, adapter: Path | None, sequences: list[list[int]], num_prompt: list[int],
                  num_heads: int, batch: int = 16):
    """(rows [N, H], targets [N, K] with -100 past the end, each row's sequence index [N], the final norm, the
    lm_head weight) over the answer positions: row p's base token is sequence[p + 1], head i's target
    sequence[p + 2 + i]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    base = model.get_base_model() if adapter is not None else model
    norm = base.model.norm
    captured = []
    hook = norm.register_forward_hook(lambda module, args, out: captured.append(args[0].detach()))
    per_seq: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    with torch.no_grad():
        # Batches of similar lengths, right-padded: causal attention keeps each row's real positions exact.
        order = sorted(range(len(sequences)), key=lambda j: len(sequences[j]))
        for start in range(0, len(order), batch):
            group = order[start : start + batch]
            width = max(len(sequences[j]) for j in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for r, j in enumerate(group):
                ids[r, : len(sequences[j])] = torch.tensor(sequences[j])
                mask[r, : len(sequences[j])] = 1
            model(input_ids=ids, attention_mask=mask)
            hs = captured.pop()  # [B, L, H]: the last layer's output, before the norm
            for r, j in enumerate(group):
                per_seq[j] = hs[r, num_prompt[j] - 1 : len(sequences[j]) - 2]
    rows, targets, owner = [], [], []  # in sequence order, each sequence's positions in order
    for j, (seq, n) in enumerate(zip(sequences, num_prompt)):
        rows.append(per_seq[j])
        for p in range(n - 1, len(seq) - 2):
            targets.append([seq[p + 2 + i] if p + 2 + i < len(seq) else -100 for i in range(num_heads)])
            owner.append(j)
    hook.remove()
    return torch.cat(rows), torch.tensor(targets), torch.tensor(owner), norm, base.lm_head.weight.detach()


def head_logits(weight, bias, h, norm, lm_head) -> torch.Tensor:
    """h [B, H] -> [B, K, V]: each head's residual block, then the model's final norm and lm_head (in
    lm_head's dtype: training passes a bfloat16 copy, ~6x cheaper on a CPU with AMX; accuracy is float32)."""
    x = h.unsqueeze(1) + F.silu(torch.einsum("bh,koh->bko", h, weight) + bias)
    return (norm(x).to(lm_head.dtype) @ lm_head.T).float()


def head_guesses(weight, bias, h, norm, lm_head, vocab: torch.Tensor | None) -> torch.Tensor:
    """h [B, H] -> [B, K] each head's top-1 token id, over the draft vocabulary's ids (None: every id)."""
    if vocab is None:
        return head_logits(weight, bias, h, norm, lm_head).argmax(-1)
    return vocab[head_logits(weight, bias, h, norm, lm_head[vocab]).argmax(-1)]


def draft_vocab(sequences: list[list[int]], prompts: list[list[int]], vocab_size: int, size: int) -> torch.Tensor | None:
    """The heads' draft vocabulary: the answers' tokens, most frequent first (ties by id), then the lowest ids
    not among them up to `size` (a BPE vocabulary's early merges are its common tokens); None when `size`
    is 0 or the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = Counter(t for seq, p in zip(sequences, prompts) for t in seq[len(p):])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


def held_out_prompts(num_prompts: int, seed: int) -> torch.Tensor:
    """Held out by prompt, not by position: a held-out position's neighbours are never trained on."""
    return torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed))[: max(1, num_prompts // 10)]


def accuracy(weight, bias, rows, targets, norm, lm_head, vocab) -> list[float]:
    """Each head's top-1 accuracy over rows (float32, over the draft vocabulary as serving drafts)."""
    out = []
    with torch.no_grad():
        for i in range(weight.shape[0]):
            chosen = torch.cat([head_guesses(weight[i : i + 1], bias[i : i + 1], rows[j : j + 256], norm, lm_head,
                                             vocab)[:, 0] for j in range(0, len(rows), 256)])
            want = targets[:, i]
            valid = want != -100
            out.append(round((chosen[valid] == want[valid]).float().mean().item(), 4))
    return out


def add_draft_vocab(model_dir: Path, out: Path, prompts: list[list[int]], *, adapter: Path | None = None,
                    max_tokens: int = 128, draft_vocab_size: int = DRAFT_VOCAB_SIZE, seed: int = 0, log=print) -> dict:
    """The heads in `out` (trained on these prompts, answers of max_tokens), given a draft vocabulary from
    the same answers; their train_log.json gains the held-out accuracy over it."""
    t0 = time.monotonic()
    sequences = generate(model_dir, adapter, prompts, max_tokens)
    log(f"generated {sum(len(s) - len(p) for s, p in zip(sequences, prompts))} tokens in {time.monotonic() - t0:.0f} s")
    log_path = out / "train_log.json"
    doc = json.loads(log_path.read_text())
    config = json.loads((out / "medusa_config.json").read_text())
    vocab = draft_vocab(sequences, prompts, config["vocab_size"], draft_vocab_size)
    held = held_out_prompts(len(prompts), seed).tolist()
    heads = read_heads_dir(out, config["hidden_size"], config["vocab_size"])
    rows, targets, _, norm, lm_head = hidden_states(model_dir, adapter, [sequences[j] for j in held],
                                                    [len(prompts[j]) for j in held], heads.num_heads)
    save_heads(out, HeadWeights(heads.weight, heads.bias, vocab), config["vocab_size"])
    doc.pop("draft_vocab_source", None)  # a vocabulary set some other way, now replaced
    doc |= {"draft_vocab": len(vocab) if vocab is not None else None,
            "held_out_top1_accuracy_full_vocab": doc["held_out_top1_accuracy"],
            "held_out_top1_accuracy": accuracy(heads.weight, heads.bias, rows, targets, norm, lm_head, vocab)}
    log_path.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"held-out top-1 accuracy per head over the draft vocabulary: {doc['held_out_top1_accuracy']}; wrote {out}")
    return doc


def train(model_dir: Path, out: Path, prompts: list[list[int]], *, adapter: Path | None = None, num_heads: int = 4,
          max_tokens: int = 128, steps: int = 300, batch_size: int = 64, lr: float = 3e-3,
          lr_schedule: str = "cosine", draft_vocab_size: int = DRAFT_VOCAB_SIZE, seed: int = 0, log=print) -> dict:
    torch.manual_seed(seed)
    t0 = time.monotonic()
    sequences = generate(model_dir, adapter, prompts, max_tokens)
    log(f"generated {sum(len(s) - len(p) for s, p in zip(sequences, prompts))} tokens in {time.monotonic() - t0:.0f} s")
    rows, targets, owner, norm, lm_head = hidden_states(model_dir, adapter, sequences, [len(p) for p in prompts],
                                                        num_heads)
    vocab = draft_vocab(sequences, prompts, lm_head.shape[0], draft_vocab_size)
    log(f"{len(rows)} answer positions ({time.monotonic() - t0:.0f} s)")
    for p in norm.parameters():
        p.requires_grad_(False)
    is_held = torch.isin(owner, held_out_prompts(len(prompts), seed))
    held, train_rows = is_held.nonzero().flatten(), (~is_held).nonzero().flatten()
    hidden = rows.shape[1]
    weight = torch.zeros(num_heads, hidden, hidden, requires_grad=True)
    bias = torch.zeros(num_heads, hidden, requires_grad=True)
    opt = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    # cosine: a linear warm-up, then cosine decay to zero (the loss was still falling steeply at a constant
    # rate's end of 300 steps); constant: lr throughout.
    if lr_schedule not in ("cosine", "constant"):
        raise ValueError(f"lr_schedule {lr_schedule!r}: cosine or constant")
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, (lambda s: 1.0) if lr_schedule == "constant" else (
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    train_head = lm_head.to(torch.bfloat16)
    losses = []
    for step in range(steps):
        pick = train_rows[torch.randint(len(train_rows), (batch_size,))]
        logits = head_logits(weight, bias, rows[pick], norm, train_head)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[pick].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(round(loss.item(), 4))
        if step % 25 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)")
    weight, bias = weight.detach(), bias.detach()
    top1 = accuracy(weight, bias, rows[held], targets[held], norm, lm_head, vocab)
    save_heads(out, HeadWeights(weight, bias, vocab), lm_head.shape[0])
    doc = {"model": str(model_dir), "adapter": str(adapter) if adapter else None, "num_heads": num_heads,
           "prompts": len(prompts), "positions": len(rows), "held_out": len(held), "steps": steps,
           "batch_size": batch_size, "lr": lr, "lr_schedule": lr_schedule, "seed": seed, "seconds": round(time.monotonic() - t0, 1),
           "draft_vocab": len(vocab) if vocab is not None else None, "held_out_top1_accuracy": top1, "loss": losses}
    (out / "train_log.json").write_text(json.dumps(doc, indent=1) + "\n")
    log(f"held-out top-1 accuracy per head: {top1}; wrote {out}")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the base model's directory (HF layout)")
    ap.add_argument("--out", type=Path, required=True, help="where the heads go")
    ap.add_argument("--adapter", type=Path, default=None, help="a PEFT adapter: train that adapter's heads")
    ap.add_argument("--prompts", type=Path, default=None, help="one prompt per line (default: this script's)")
    ap.add_argument("--short-only", action="store_true", help="only the short chat prompts, no essays")
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128, help="answer length generated per prompt")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                    help="cosine: a warm-up over 5%% of the steps, then cosine decay to 0")
    ap.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB_SIZE,
                    help="ids in the heads' draft vocabulary (0: the whole vocabulary)")
    ap.add_argument("--add-draft-vocab", action="store_true",
                    help="no training: add a draft vocabulary to the heads in OUT (same prompts and --max-tokens)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    if args.prompts and args.short_only:
        ap.error("--short-only picks among this script's prompts: not with --prompts")
    training_only = [f"--{k.replace('_', '-')}" for k in ("num_heads", "steps", "batch_size", "lr", "lr_schedule")
                     if getattr(args, k) != ap.get_default(k)]
    if args.add_draft_vocab and training_only:
        ap.error(f"--add-draft-vocab trains nothing: not with {training_only[0]}")
    texts = (args.prompts.read_text().splitlines() if args.prompts
             else short_prompts() if args.short_only else default_prompts())
    rng = random.Random(args.seed)
    rng.shuffle(texts)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model), [t for t in texts if t.strip()])
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.add_draft_vocab:
        add_draft_vocab(args.model, args.out, prompts, adapter=args.adapter, max_tokens=args.max_tokens,
                        draft_vocab_size=args.draft_vocab, seed=args.seed, log=log)
        return 0
    train(args.model, args.out, prompts, adapter=args.adapter, num_heads=args.num_heads, max_tokens=args.max_tokens,
          steps=args.steps, batch_size=args.batch_size, lr=args.lr, lr_schedule=args.lr_schedule,
          draft_vocab_size=args.draft_vocab, seed=args.seed, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
