"""Sampling, stopping and incremental detokenisation."""
from __future__ import annotations

import time

import pytest

from server.engine import LLM, SamplingParams
from server.engine.output_text import OutputTexts
from tests.engine_helpers import random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=256, max_model_len=512)
    llm.add_adapter("a", tiny_adapters["r8_all"])
    return llm


def test_seeded_sampling_ignores_batch_neighbours(llm):
    prompt = random_prompts(1, (12, 12), VOCAB, seed=21)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, adapters=["a"])[0].token_ids
    others = random_prompts(5, (3, 30), VOCAB, seed=22)
    mixed = llm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True)] * 3 + [params]
        + [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * 2,
        adapters=[None, "a", None, "a", "a", None],
    )[3].token_ids
    assert mixed == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=99, ignore_eos=True)
    assert llm.generate([prompt], other_seed, adapters=["a"])[0].token_ids != alone


def test_seeded_sampling_survives_preemption(tiny_model_dir):
    prompts = random_prompts(6, (20, 30), VOCAB, seed=23)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    roomy = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=128, max_model_len=128)
    tight = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=10, max_model_len=128)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.stats().scheduler.preemptions > 0
    assert got == expected


def test_top_k_one_is_greedy(llm):
    prompt = random_prompts(1, (10, 10), VOCAB, seed=24)[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts(1, (10, 10), VOCAB, seed=25)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_at = full.token_ids[4]
    first = full.token_ids.index(stop_at)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]


def test_stop_string_truncates_text(llm):
    prompt = random_prompts(1, (10, 10), VOCAB, seed=26)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_eos_ends_generation_unless_ignored(llm, tiny_model_dir):
    eos = llm.tokenizer.eos_token_id
    # Find a prompt whose greedy continuation reaches EOS within a few tokens.
    for prompt in random_prompts(200, (3, 12), VOCAB, seed=27):
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        if eos in out.token_ids:
            break
    else:
        pytest.skip("no prompt reaches EOS greedily")
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(eos) + 1]


def test_stream_text_is_incremental_and_multibyte_whole(llm):
    tok = llm.tokenizer
    text = "naïve café 中文 😀 done"
    ids = tok(text, add_special_tokens=False).input_ids
    # Feed the tokens of a known string through the detokenizer one at a time.
    det = llm.engine.detokenizer
    assert det.token_bytes is not None  # the byte-level fast path is the one under test
    state, pieces = det.new_state(), []
    for i in range(1, len(ids) + 1):
        piece = det.step(state, ids[:i])
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(det.flush(state, ids))
    assert "".join(pieces) == tok.decode(ids)
    assert "".join(pieces) == text


def test_window_detokenizer_agrees_with_byte_table(llm):
    from server.engine.output_text import IncrementalDetokenizer

    tok = llm.tokenizer
    window = IncrementalDetokenizer(tok)
    window.token_bytes = None  # force the generic path
    fast = llm.engine.detokenizer
    ids = random_prompts(1, (60, 60), VOCAB, seed=29)[0] + tok("é中😀", add_special_tokens=False).input_ids
    ids = [1, 0] + ids  # special tokens are skipped by both
    results = []
    for det in (window, fast):
        state = det.new_state()
        text = "".join(det.step(state, ids[:i]) for i in range(1, len(ids) + 1)) + det.flush(state, ids)
        results.append(text)
    assert results[0] == results[1] == tok.decode(ids, skip_special_tokens=True)


def test_streamed_outputs_grow_monotonically(llm):
    engine = llm.engine
    prompt = random_prompts(1, (8, 8), VOCAB, seed=28)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("stream", prompt, params)
    front = OutputTexts(engine.detokenizer, engine.abort_choice)  # the text is the front end's
    front.add("stream", params)
    texts, last = [], None
    while engine.has_unfinished_requests():
        for out in front.apply(engine.step()):
            texts.append(out.text)
            last = out
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert last.finished and len(last.token_ids) == 12 and last.text


# ---- n choices ----

def test_greedy_choices_are_identical(llm):
    prompt = random_prompts(1, (20, 20), VOCAB, seed=30)[0]
    single = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), adapters="a")[0]
    assert single.choices is None and single.outputs == [single]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True), adapters="a")[0]
    assert out.choices is not None and out.outputs is out.choices and out.choices[0] is out
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.token_ids == single.token_ids and c.text == single.text for c in out.choices)
    assert all(c.finished and c.finish_reason == "length" for c in out.choices)


def choose_stop(first: str, second: str) -> str:
    """A string that occurs early in `first` (not at its start) and nowhere in `second`."""
    for start in range(1, len(first) - 3):
        for length in (2, 3, 4):
            stop = first[start:start + length]
            if stop.strip() and stop not in second and first.index(stop) < len(first) // 3:
                return stop
    raise AssertionError(f"no stop string tells {first!r} from {second!r}")


def test_a_stop_string_stops_its_choice_in_the_engine_while_the_other_runs_on(llm):
    prompt = random_prompts(1, (12, 12), VOCAB, seed=33)[0]
    free = llm.generate([prompt], SamplingParams(n=2, max_tokens=48, temperature=1.0, seed=8, ignore_eos=True))[0]
    first, second = free.choices
    stop = choose_stop(first.text, second.text)
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=48, temperature=1.0, seed=8, ignore_eos=True, stop=[stop])
    engine.add_request("s", prompt, params)
    choices = engine.output_processor.seqs["s"].group.seqs
    front = OutputTexts(engine.detokenizer, engine.abort_choice)  # the front end, as the LLM API's
    front.add("s", params)
    generated = engine.stats().scheduler.generated_tokens
    final = {}
    while engine.has_unfinished_requests():
        for out in front.apply(engine.step()):
            if out.finished:
                final[out.index] = out
    assert (final[0].text, final[0].finish_reason) == (first.text[:first.text.index(stop)], "stop")
    assert (final[1].token_ids, final[1].text, final[1].finish_reason) == (second.token_ids, second.text, "length")
    kept = len(final[0].token_ids)
    assert final[0].token_ids == first.token_ids[:kept] and kept < 24
    # Its abort reached the engine before the next step: choice 0 ran no token past the stop, choice 1 on.
    assert choices[0].num_output_tokens == kept and choices[0].finish_reason == "abort"
    assert engine.stats().scheduler.generated_tokens - generated == kept + 48


def test_seeded_choices_are_distinct_and_reproducible(llm):
    prompt = random_prompts(1, (15, 15), VOCAB, seed=31)[0]
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)

    def choices(out):
        return [c.token_ids for c in out.outputs]

    alone = choices(llm.generate([prompt], params, adapters="a")[0])
    assert len({tuple(c) for c in alone}) == 4
    assert choices(llm.generate([prompt], params, adapters="a")[0]) == alone
    others = random_prompts(3, (3, 30), VOCAB, seed=32)
    mixed = llm.generate([others[0], prompt, others[1], others[2]],
                         [SamplingParams(n=2, max_tokens=7, temperature=0.9, ignore_eos=True), params,
                          SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                          SamplingParams(n=3, max_tokens=9, temperature=1.0, seed=77, ignore_eos=True)],
                         adapters=[None, "a", "a", None])
    assert choices(mixed[1]) == alone
    # Choice 0 draws what the same seed draws for a request of one choice.
    single = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)
    assert llm.generate([prompt], single, adapters="a")[0].token_ids == alone[0]


def test_stream_yields_every_choice_and_abort_ends_them_all(llm):
    import asyncio

    from server.engine.async_engine import AsyncEngine
    from server.engine.protocol import EngineRequest

    engine = AsyncEngine(llm.engine)
    prompt = random_prompts(1, (10, 10), VOCAB, seed=33)[0]

    async def scenario():
        params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
        stream = await engine.submit(EngineRequest("s1", prompt, params))
        last = {}
        async for out in stream:
            assert out.request_id == "s1" and not last.get(out.index, out).finished
            last[out.index] = out
        assert sorted(last) == [0, 1, 2] and all(o.finished and len(o.token_ids) == 6 for o in last.values())

        # A consumer that fell behind gets only the newest output of each choice.
        params = SamplingParams(n=2, max_tokens=5, temperature=0.0, ignore_eos=True)
        late = await engine.submit(EngineRequest("s2", prompt, params))
        # Until both choices' last outputs reached the stream's sink: the step loop's thread posts them to
        # this loop after the scheduler lets the sequences go, so an idle scheduler alone is not enough.
        deadline = time.monotonic() + 30
        while not (len(late._sink.pending) == 2 and all(o.finished for o in late._sink.pending.values())):
            assert time.monotonic() < deadline, late._sink.pending
            await asyncio.sleep(0.01)
        got = [out async for out in late]
        assert sorted(o.index for o in got) == [0, 1] and all(o.finished and len(o.token_ids) == 5 for o in got)

        params = SamplingParams(n=3, max_tokens=400, temperature=1.0, ignore_eos=True)
        stream = await engine.submit(EngineRequest("s3", prompt, params))
        first = await stream.__anext__()
        assert not first.finished
        engine.abort("s3")
        ends = {}
        async for out in stream:
            if out.finished:
                ends[out.index] = out.finish_reason
        assert ends == {0: "abort", 1: "abort", 2: "abort"}

        params = SamplingParams(n=3, max_tokens=400, ignore_eos=True)
        stream = await engine.submit(EngineRequest("s4", prompt, params))
        engine.abort("s4")  # most likely before the prompt ran
        assert sorted((o.index, o.finish_reason) for o in [out async for out in stream] if o.finished) == \
            [(0, "abort"), (1, "abort"), (2, "abort")]

    engine.start()
    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert llm.engine.stats().kv_blocks.used == 0 and not llm.engine.seqs and not engine._sinks


def test_abort_before_the_prefill_ends_every_choice(llm):
    engine = llm.engine
    engine.add_request("early", [5, 6, 7], SamplingParams(n=3, max_tokens=4))
    engine.abort_request("early")
    outs = engine.step()
    assert sorted((o.index, o.finish_reason, o.finished) for o in outs) == [(i, "abort", True) for i in range(3)]
    assert not engine.has_unfinished_requests() and not engine.seqs
