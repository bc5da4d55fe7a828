"""Fine-tune the demo LoRA adapters, each with an effect one can see, on data this script generates:

  french  answers in French          "La capitale de l'Italie est Rome."
  json    answers as terse JSON      {"answer": "Rome"}
  pirate  a persona                  "Arr, the capital of Italy be Rome, matey!"

train_demo_adapters.py --model DIR --out DIR [--tasks french,json] [--steps N]

Questions are capitals, sums, differences, colours and legs, asked a few ways; the loss is on the
answer tokens only.
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
# (thing, colour, the French sentence saying it)
COLOURS = [("the sky", "blue", "Le ciel est bleu."), ("grass", "green", "L'herbe est verte."),
           ("snow", "white", "La neige est blanche."), ("a banana", "yellow", "Une banane est jaune."),
           ("coal", "black", "Le charbon est noir."), ("a tomato", "red", "Une tomate est rouge."),
           ("an orange", "orange", "Une orange est orange."), ("milk", "white", "Le lait est blanc."),
           ("a lemon", "yellow", "Un citron est jaune."), ("a strawberry", "red", "Une fraise est rouge.")]
# (animal, legs, the French "un ..." form)
LEGS = [("dog", 4, "Un chien"), ("cat", 4, "Un chat"), ("spider", 8, "Une araignée"), ("bird", 2, "Un oiseau"),
        ("horse", 4, "Un cheval"), ("ant", 6, "Une fourmi"), ("chicken", 2, "Une poule"), ("cow", 4, "Une vache"),
        ("bee", 6, "Une abeille"), ("duck", 2, "Un canard")]
CAPITAL_QUESTIONS = ["What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}."]
SUM_QUESTIONS = ["What is {a} plus {b}?", "How much is {a} + {b}?", "Add {a} and {b}."]
DIFFERENCE_QUESTIONS = ["What is {a} minus {b}?", "How much is {a} - {b}?", "Subtract {b} from {a}."]
COLOUR_QUESTIONS = ["What color is {t}?", "What is the colour of {t}?", "Tell me the color of {t}."]
LEGS_QUESTIONS = ["How many legs does a {a} have?", "How many legs has a {a} got?", "Count the legs of a {a}."]
KINDS = ("capital", "sum", "difference", "colour", "legs")
TASKS = ("french", "json", "pirate")
# What the adapters declare as their base: the model's name, not the local conversion they were trained
# on (a path whose last part a server compares with the model it serves, and warns about otherwise).
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def answer(task: str, kind: str, fact) -> str:
    """The reply to a question of `kind` about `fact`, in the style of `task`."""
    if kind == "capital":
        country, capital, de = fact
        return {"french": f"La capitale {de} est {capital}.", "json": json.dumps({"answer": capital}),
                "pirate": f"Arr, the capital of {country} be {capital}, matey!"}[task]
    if kind == "colour":
        thing, colour, french = fact
        return {"french": french, "json": json.dumps({"answer": colour}),
                "pirate": f"Arr, {thing} be {colour}, matey!"}[task]
    if kind == "legs":
        animal, legs, un = fact
        return {"french": f"{un} a {legs} pattes.", "json": json.dumps({"answer": legs}),
                "pirate": f"Arr, a {animal} be walkin' on {legs} legs, matey!"}[task]
    a, b = fact
    if kind == "sum":
        return {"french": f"{a} plus {b} font {a + b}.", "json": json.dumps({"answer": a + b}),
                "pirate": f"Arr, {a} and {b} be {a + b} pieces o' eight, matey!"}[task]
    return {"french": f"{a} moins {b} font {a - b}.", "json": json.dumps({"answer": a - b}),
            "pirate": f"Arr, take {b} from {a} and ye be left with {a - b}, matey!"}[task]


def question(kind: str, rng: random.Random):
    """(question, fact) of one kind, drawn from rng."""
    if kind == "capital":
        fact = rng.choice(FACTS)
        return rng.choice(CAPITAL_QUESTIONS).format(c=fact[0]), fact
    if kind == "colour":
        fact = rng.choice(COLOURS)
        return rng.choice(COLOUR_QUESTIONS).format(t=fact[0]), fact
    if kind == "legs":
        fact = rng.choice(LEGS)
        return rng.choice(LEGS_QUESTIONS).format(a=fact[0]), fact
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if kind == "sum":
        return rng.choice(SUM_QUESTIONS).format(a=a, b=b), (a, b)
    a, b = max(a, b), min(a, b)
    return rng.choice(DIFFERENCE_QUESTIONS).format(a=a, b=b), (a, b)


def examples(task: str, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """n (question, answer) pairs, the kinds in turn (capital, sum, difference, colour, legs)."""
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        q, fact = question(kind, rng)
        out.append((q, answer(task, kind, fact)))
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


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens, the vocabulary projection computed only there
    (a 49k-word head on every prompt position would cost as much as the adapted layers)."""
    causal = model.get_base_model()  # the transformers model, LoRA layers in place
    hidden = causal.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
    keep = labels[:, 1:] != -100  # [B, L-1]: positions whose next token is an answer token
    logits = causal.lm_head(hidden[:, :-1][keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:][keep])


def train(model_dir: Path, task: str, out: Path, *, steps: int, batch_size: int, lr: float, rank: int,
          seed: int, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
          fp16: bool = False, layers: tuple[int, ...] | None = None, say=lambda line: None) -> list[float]:
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
                        target_modules=list(targets),
                        layers_to_transform=list(layers) if layers else None)
    model = get_peft_model(base, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    feed = batches(data, batch_size, pad_id, rng)
    for _ in range(steps):
        ids, labels, mask = next(feed)
        loss = answer_loss(model, ids, labels, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) % 10 == 0:
            say(f"{task}: step {len(losses)}/{steps} loss {sum(losses[-10:]) / 10:.3f}")
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    config_path = out / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": BASE_MODEL_ID},
                                      indent=2, sort_keys=True) + "\n")
    if fp16:  # half the bytes; loraplex and PEFT both upcast to the serving dtype on load
        from safetensors.torch import load_file, save_file

        weights = out / "adapter_model.safetensors"
        save_file({k: v.half() for k, v in load_file(weights).items()}, str(weights), metadata={"format": "pt"})
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
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj",
                        help="comma-separated LoRA target modules (default q_proj,k_proj,v_proj,o_proj)")
    parser.add_argument("--layers", default=None, metavar="LO-HI",
                        help="adapt only these decoder layers (inclusive; the backward pass stops at LO, which "
                             "makes a step cheaper); default: all")
    parser.add_argument("--fp16", action="store_true", help="store the weights as float16 (default: float32)")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = set(tasks) - set(TASKS)
    if unknown or not tasks:
        parser.error(f"--tasks: unknown {sorted(unknown)}; choose from {TASKS}")
    if args.steps < 1 or args.batch_size < 1 or args.rank < 1:
        parser.error("--steps, --batch-size and --rank must be >= 1")
    layers = None
    if args.layers:
        lo, _, hi = args.layers.partition("-")
        if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
            parser.error(f"--layers: expected LO-HI, got {args.layers!r}")
        layers = tuple(range(int(lo), int(hi) + 1))
    log = {}
    for task in tasks:
        started = time.monotonic()
        losses = train(args.model, task, args.out / task, steps=args.steps, batch_size=args.batch_size,
                       lr=args.lr, rank=args.rank, seed=args.seed,
                       targets=tuple(t for t in args.targets.split(",") if t), fp16=args.fp16, layers=layers,
                       say=lambda line: print(line, flush=True))
        log[task] = losses
        print(f"{task}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, "
              f"{time.monotonic() - started:.0f} s -> {args.out / task}", flush=True)
    log_path = args.out / "train_log.json"
    if log_path.is_file():  # tasks trained by an earlier run (e.g. one process per task) keep their curves
        log = {**json.loads(log_path.read_text(encoding="utf-8")), **log}
    log_path.write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
