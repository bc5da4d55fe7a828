"""The real-model evaluation's oracle: transformers + peft on the same converted model, greedy, in
float32. Items whose rendered prompts have the same length run as one batch (no padding, so each row
computes what it would alone); the replies stop at the model's end-of-sequence token, as the server's do,
and list it among their tokens, as the API's logprobs do."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.eval.eval_http import Reply, messages
from server.bench.eval_items import EvalItem


def _prompt_ids(tokenizer, item: EvalItem) -> list[int]:
    out = tokenizer.apply_chat_template(messages(item), tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


@torch.no_grad()
def _generate(model, rows: list[list[int]], max_tokens: int, eos: set[int], pad: int) -> list[list[int]]:
    ids = torch.tensor(rows)  # [B, L]: equal lengths, no padding
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=pad, eos_token_id=sorted(eos))
    replies = []
    for row in out[:, ids.shape[1]:].tolist():  # [B, <= max_tokens]
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        replies.append(row[:cut + 1] if cut is not None else row)  # the end token too, as the API's logprobs list it
    return replies


def peft_replies(model_dir: Path, adapters: dict[str, Path], models: list[str], items: list[EvalItem], *,
                 max_tokens: int, base_name: str, batch_size: int = 16) -> dict[str, list[Reply]]:
    """model name (base_name or an adapter's) -> one Reply per item, in item order."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.api.token_text import TokenText

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = TokenText(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = {base.config.eos_token_id} if isinstance(base.config.eos_token_id, int) else set(base.config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    names = [m for m in models if m != base_name]
    model = base
    if names:
        model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapters[name], adapter_name=name)
    prompts = [_prompt_ids(tokenizer, it) for it in items]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    result: dict[str, list[Reply]] = {}
    for name in models:
        out: list[Reply | None] = [None] * len(items)
        for group in by_len.values():
            for start in range(0, len(group), batch_size):
                chunk = group[start:start + batch_size]
                rows = [prompts[i] for i in chunk]
                if name != base_name:
                    model.set_adapter(name)
                with model.disable_adapter() if name == base_name and names else nullcontext():
                    gen = _generate(model, rows, max_tokens, eos, pad)
                for i, ids in zip(chunk, gen):
                    out[i] = Reply(tokenizer.decode(ids, skip_special_tokens=True),
                                   tuple(texts.text(t) for t in ids), prompt_tokens=len(prompts[i]))
        result[name] = out
    return result
