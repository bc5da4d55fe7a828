"""The real-model evaluation's HTTP side: every item to every model (base or adapter) through
/v1/chat/completions with the `openai` client, greedy, with per-token logprobs so a reply that differs
from the oracle's can be told at its first diverging token."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from server.bench.eval_items import EvalItem


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: tuple[str, ...]                    # each generated token's text, as the API returns it
    top2: tuple[tuple[float, ...], ...] = ()   # per token: the top logprobs (HTTP side), for near-ties
    prompt_tokens: int = 0
    finish_reason: str = ""


def messages(item: EvalItem) -> list[dict]:
    return [{"role": "user", "content": item.question}]


async def _ask(client, sem: asyncio.Semaphore, model: str, item: EvalItem, max_tokens: int) -> Reply:
    async with sem:
        r = await client.chat.completions.create(model=model, messages=messages(item), max_tokens=max_tokens,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    content = choice.logprobs.content if choice.logprobs else []
    return Reply(choice.message.content or "", tuple(t.token for t in content),
                 tuple(tuple(x.logprob for x in t.top_logprobs) for t in content), r.usage.prompt_tokens,
                 choice.finish_reason)


async def _run(base_url: str, key: str, models: list[str], items: list[EvalItem], max_tokens: int,
               concurrency: int) -> dict[str, list[Reply]]:
    from openai import AsyncOpenAI

    sem = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key=key, timeout=600.0, max_retries=0) as client:
        per_model = [asyncio.gather(*(_ask(client, sem, m, it, max_tokens) for it in items)) for m in models]
        results = await asyncio.gather(*per_model)
    return dict(zip(models, results))


def http_replies(base_url: str, key: str, models: list[str], items: list[EvalItem], *, max_tokens: int,
                 concurrency: int = 32) -> dict[str, list[Reply]]:
    """model name -> one Reply per item, in item order; `concurrency` requests in flight, so the
    server batches them as it would any traffic."""
    return asyncio.run(_run(base_url, key, models, items, max_tokens, concurrency))
