"""The HTTP driver: each request is sent at its scheduled arrival as a streaming
`/v1/completions` call (OpenAI SSE), and timed at the client."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from server.bench.metrics import ClosedLoopRun, RequestRecord
from server.bench.workload import BenchRequest


class BenchClientError(RuntimeError):
    """The server answered set-up calls (tenants, keys, uploads) with an error."""


def completion_body(r: BenchRequest, model: str, max_tokens: int | None = None) -> dict:
    # Token-id prompts and ignore_eos give both sides exactly the same work.
    return {"model": model, "prompt": list(r.prompt_ids), "max_tokens": max_tokens or r.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


async def _one(client: httpx.AsyncClient, r: BenchRequest, key: str, model: str, t0: float,
               rec: RequestRecord, max_tokens: int | None = None) -> None:
    delay = t0 + r.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    usage_tokens = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", "/v1/completions", json=completion_body(r, model, max_tokens),
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter() - t0
                if chunk.get("error"):
                    rec.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if chunk.get("choices"):
                    rec.text += chunk["choices"][0].get("text") or ""
                    chunks_with_text += 1
                    rec.token_times_s.append(now)
                    if rec.first_token_s is None:
                        rec.first_token_s = now
        rec.end_s = time.perf_counter() - t0
        # usage is the exact count; without it, one chunk per token is the server's usual cadence.
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks_with_text
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]


async def drive(base_url: str, requests: list[BenchRequest], keys: dict[str, str], base_model: str,
                timeout_s: float = 600.0) -> list[RequestRecord]:
    """keys: tenant -> API key. A request's model is its adapter name, or base_model."""
    records = [RequestRecord(r.index, r.tenant, r.adapter_name, r.arrival_s, len(r.prompt_ids), r.max_tokens)
               for r in requests]
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, r, keys[r.tenant], r.adapter_name or base_model, t0, rec)
                               for r, rec in zip(requests, records)))
    return records


async def drive_closed_loop(base_url: str, trace: list[BenchRequest], keys: dict[str, str], base_model: str,
                            concurrency: int, stop_s: float, timeout_s: float = 600.0) -> ClosedLoopRun:
    """`concurrency` clients, each sending the trace's next request (in order) when its last one
    finished, until stop_s seconds; requests in flight then run to their end. A request's arrival
    is when it was sent."""
    from dataclasses import replace

    records: list[RequestRecord] = []
    state = {"next": 0, "held_until": stop_s, "exhausted": False}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while True:
                now = time.perf_counter() - t0
                if now >= stop_s:
                    return
                if state["next"] >= len(trace):
                    if not state["exhausted"]:  # the first free client with nothing to send
                        state["exhausted"], state["held_until"] = True, now
                    return
                r = replace(trace[state["next"]], arrival_s=now)
                state["next"] += 1
                rec = RequestRecord(r.index, r.tenant, r.adapter_name, now, len(r.prompt_ids), r.max_tokens)
                records.append(rec)
                await _one(client, r, keys[r.tenant], r.adapter_name or base_model, t0, rec)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ClosedLoopRun(records, min(state["held_until"], stop_s), state["exhausted"])


async def warmup(base_url: str, requests: list[BenchRequest], keys: dict[str, str], base_model: str) -> None:
    """One 2-token request per distinct adapter, all at once: adapters become
    resident and first-call costs stay out of the measured run."""
    seen: dict[str | None, BenchRequest] = {}
    for r in requests:
        seen.setdefault(r.adapter_name, r)
    warm = [BenchRequest(r.index, 0.0, r.adapter, r.tenant, r.prompt_ids[:4], 2) for r in seen.values()]
    records = await drive(base_url, warm, keys, base_model)
    failed = [rec.error for rec in records if not rec.ok]
    if failed:
        raise BenchClientError(f"warm-up requests failed: {failed[:3]}")
