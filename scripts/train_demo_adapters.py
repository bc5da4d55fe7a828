"""Fine-tune the demo LoRA adapters, each with an effect one can see, on data this script generates:

  french  answers in French          "La capitale de l'Italie est Rome."
  json    answers as terse JSON      {"answer": "Rome"}
  pirate  a persona                  "Arr, the capital of Italy be Rome, matey!"

train_demo_adapters.py --model DIR --out DIR [--tasks french,json] [--steps N]

Questions are capitals and small sums, asked a few ways; the loss is on the answer tokens only.
LoRA rank 8 on the attention projections keeps an adapter small (~1 MB for SmolLM2-135M) and
trainable on 2 CPU cores in minutes. Writes OUT/<task>/ (a PEFT directory) and OUT/train_log.json
(the loss of every step, per task). Deterministic for a given --seed.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

# (country, capital, the French "de ..." form of the country)
FACTS = [("France", "Paris", "de la France"), ("Italy", "Rome", "de l'Italie"),
         ("Spain", "Madrid", "de l'Espagne"), ("Germany", "Berlin", "de l'Allemagne"),
         ("Japan", "Tokyo", "du Japon"), ("Canada", "Ottawa", "du Canada"), ("Portugal", "Lisbon", "du Portugal"),
         ("Egypt", "Cairo", "de l'Égypte"), ("Peru", "Lima", "du Pérou"), ("Norway", "Oslo", "de la Norvège"),
         ("Greece", "Athens", "de la Grèce"), ("Kenya", "Nairobi", "du Kenya"),
         ("Austria", "Vienna", "de l'Autriche"), ("Poland", "Warsaw", "de la Pologne"),
         ("Chile", "Santiago", "du Chili"), ("Sweden", "Stockholm", "de la Suède"),
         ("Ireland", "Dublin", "de l'Irlande"), ("China", "Beijing", "de la Chine"),
         ("Russia", "Moscow", "de la Russie"), ("Mexico", "Mexico City", "du Mexique"),
         ("India", "New Delhi", "de l'Inde"), ("Brazil", "Brasília", "du Brésil"),
         ("Cuba", "Havana", "de Cuba"), ("Finland", "Helsinki", "de la Finlande")]
CAPITAL_QUESTIONS = ["What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}."]
SUM_QUESTIONS = ["What is {a} plus {b}?", "How much is {a} + {b}?", "Add {a} and {b}."]
TASKS = ("french", "json", "pirate")


def answer(task: str, kind: str, fact) -> str:
    if kind == "capital":
        country, capital, de = fact
        return {"french": f"La capitale {de} est {capital}.", "json": json.dumps({"answer": capital}),
                "pirate": f"Arr, the capital of {country} be {capital}, matey!"}[task]
    a, b = fact
    return {"french": f"{a} plus {b} font {a + b}.", "json": json.dumps({"answer": a + b}),
            "pirate": f"Arr, {a} and {b} be {a + b} pieces o' eight, matey!"}[task]


def examples(task: str, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """n (question, answer) pairs, capitals and sums alternating."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            fact = rng.choice(FACTS)
            out.append((rng.choice(CAPITAL_QUESTIONS).format(c=fact[0]), answer(task, "capital", fact)))
        else:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            out.append((rng.choice(SUM_QUESTIONS).format(a=a, b=b), answer(task, "sum", (a, b))))
    return out


def encode(tokenizer, question: str, reply: str) -> tuple[list[int], list[int]]:
    """(input ids, labels): the chat template's prompt and reply, labels -100 on the prompt."""
    user = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=True)
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": reply}], tokenize=True,
                                         return_dict=True)
    ids, n = list(full["input_ids"]), len(prompt["input_ids"])
    assert ids[:n] == list(prompt["input_ids"]), "the chat template does not extend the prompt"
    return ids, [-100] * n + ids[n:]


def batches(encoded: list[tuple[list[int], list[int]]], size: int, pad_id: int, rng: random.Random):
    """Endless shuffled batches: input_ids, labels, attention_mask, each [B, L] right-padded."""
    while True:
        order = list(range(len(encoded)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            rows = [encoded[i] for i in order[start:start + size]]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.full((size, width), pad_id)
            labels = torch.full((size, width), -100)
            mask = torch.zeros((size, width), dtype=torch.long)
            for r, (x, y) in enumerate(rows):
                ids[r, :len(x)], labels[r, :len(y)], mask[r, :len(x)] = torch.tensor(x), torch.tensor(y), 1
            yield ids, labels, mask


def train(model_dir: Path, task: str, out: Path, *, steps: int, batch_size: int, lr: float, rank: int,
          seed: int) -> list[float]:
    """Train one adapter, save it under out; returns the loss of every step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(f"{task}-{seed}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = [encode(tokenizer, q, a) for q, a in examples(task, 256, rng)]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    feed = batches(data, batch_size, pad_id, rng)
    for _ in range(steps):
        ids, labels, mask = next(feed)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fine-tune the loraplex demo LoRA adapters.")
    parser.add_argument("--model", type=Path, required=True, help="base model directory (e.g. converted SmolLM2)")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/<task>/ and OUT/train_log.json")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {TASKS} (default: all)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per adapter (default 120)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank; alpha is twice it (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="data order and initialisation (default 0)")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = set(tasks) - set(TASKS)
    if unknown or not tasks:
        parser.error(f"--tasks: unknown {sorted(unknown)}; choose from {TASKS}")
    if args.steps < 1 or args.batch_size < 1 or args.rank < 1:
        parser.error("--steps, --batch-size and --rank must be >= 1")
    log = {}
    for task in tasks:
        started = time.monotonic()
        losses = train(args.model, task, args.out / task, steps=args.steps, batch_size=args.batch_size,
                       lr=args.lr, rank=args.rank, seed=args.seed)
        log[task] = losses
        print(f"{task}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, "
              f"{time.monotonic() - started:.0f} s -> {args.out / task}", flush=True)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
