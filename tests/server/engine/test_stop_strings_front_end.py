"""A stop string is the front end's to find (server.engine.output_text), in every mode: the LLM API, the
in-process client and the engine-core client end a request at a stop string that spans tokens with the
same text and usage (the tokens up to the one that completed it), never stream any of it, and end the
request in the engine too."""
from __future__ import annotations

import asyncio
import json

import pytest

from adapters.format import ModelShape
from server.engine import LLM, SamplingParams
from server.engine.async_engine import InProcessEngineClient
from server.engine.config import EngineConfig
from server.engine.core.launch import CoreLaunch
from server.engine.protocol.remote import RemoteEngineClient
from server.engine.protocol.request import EngineRequest
from tests.engine_helpers import random_prompts

VOCAB = 512
MAX_TOKENS = 24


def _config(model_dir) -> EngineConfig:
    return EngineConfig.of(model=str(model_dir), device="cpu", kv_cache_blocks=64, max_model_len=512)


@pytest.fixture(scope="module")
def case(tiny_model_dir):
    """(prompt, params with a stop string spanning tokens, expected text, expected token ids)."""
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=64, max_model_len=512)
    prompt = random_prompts(1, (10, 10), VOCAB, seed=35)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    # Text after each token: the stop string starts inside one token and ends inside a later one.
    ends = [len(decode(full.token_ids[:k])) for k in range(1, len(full.token_ids) + 1)]
    start = next(i for i in range(1, len(ends) - 4) if ends[i + 1] - ends[i] >= 2 and ends[i + 2] > ends[i + 1])
    at, end = ends[start] - 1, ends[start + 1] + 1  # the last character of token start, past token start+1
    stop = full.text[at:end]
    assert full.text.index(stop) == at, "the stop string must first occur where it was cut"
    kept = next(k for k, e in enumerate(ends, 1) if e >= end)
    assert kept == start + 3  # it spans three tokens
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1)
    return prompt, params, full.text[:at], full.token_ids[:kept], stop


def _check(outs, stop, text, token_ids) -> None:
    last = outs[-1]
    assert (last.text, last.token_ids, last.finish_reason, last.finished) == (text, token_ids, "stop", True)
    assert len(last.logprobs) == len(token_ids)
    assert all(not o.finished for o in outs[:-1]) and all(stop not in o.text for o in outs)
    assert all(b.text.startswith(a.text) for a, b in zip(outs, outs[1:]))


async def _stream(client, prompt, params) -> list:
    client.start()
    stream = await client.submit(EngineRequest("stop-1", prompt, params))
    return [out async for out in stream]


def test_llm_api(tiny_model_dir, case):
    prompt, params, text, token_ids, stop = case
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=64, max_model_len=512)
    out = llm.generate([prompt], params)[0]
    _check([out], stop, text, token_ids)
    # The front end aborted it in the engine, which reports the abort (and nothing more) at its next step.
    assert [o.finish_reason for o in llm.engine.step()] == ["abort"] and not llm.engine.has_unfinished_requests()


def test_in_process_client(tiny_model_dir, case):
    prompt, params, text, token_ids, stop = case
    client = InProcessEngineClient.build(_config(tiny_model_dir))

    async def run():
        outs = await _stream(client, prompt, params)
        # The front end aborted it: the engine no longer holds it (it did not run on to max_tokens).
        return outs, await client.call(lambda e: dict(e.output_processor.seqs))

    try:
        outs, in_flight = asyncio.run(run())
        _check(outs, stop, text, token_ids)
        assert in_flight == {}
    finally:
        client.shutdown()


def test_engine_core_client(tiny_model_dir, redis_url, core_starter, case):
    prompt, params, text, token_ids, stop = case
    shape = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    client = RemoteEngineClient.build(CoreLaunch(
        _config(tiny_model_dir), input_address="", parent_pid=0, redis_url=redis_url, redis_prefix="lp-stop:",
        adapter_grace_seconds=600.0, adapter_shape=shape, pager=False,
        max_upload_bytes=1 << 20, max_message_bytes=1 << 20), core_starter, ready_timeout=120)
    try:
        _check(asyncio.run(_stream(client, prompt, params)), stop, text, token_ids)
    finally:
        client.shutdown()
