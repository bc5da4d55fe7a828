"""OutputProcessor (server.engine.output_processor) on its own: a real scheduler and sequences, and
hand-made step results in place of the model's; its outputs' text made as a front end makes it
(server.engine.output_text's OutputTexts, the LLM API's)."""
from __future__ import annotations

import pytest

from adapters.host_tier import HostTier
from server.engine.block_manager import BlockManager
from server.engine.lora.slots import LoraSlots
from server.engine.model_runner import SeqResult
from server.engine.output_processor import OutputProcessor
from server.engine.output_text import IncrementalDetokenizer, OutputTexts
from server.engine.sampler import SampleFailure
from server.engine.scheduler import Scheduler, SchedulerLimits
from server.engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceGroup
from server.engine.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.unit

EOS = 1
PROMPT = [0, 261, 78]  # "<|bos|>hel" in the tiny model's vocabulary
LO, WOR, LD, DOT, ST, O, P = 377, 493, 311, 16, 303, 81, 82  # "lo", " wor", "ld", ".", " st", "o", "p"
MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def processor(tokenizer) -> OutputProcessor:
    blocks = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64), blocks, LoraSlots([], 1),
                          HostTier(None, None))
    processor = OutputProcessor(scheduler, frozenset({EOS}), MAX_MODEL_LEN)
    processor.texts = OutputTexts(IncrementalDetokenizer(tokenizer), processor.abort)  # the front end's
    return processor


def add(processor: OutputProcessor, request_id: str, params: SamplingParams) -> Sequence:
    """Queue a request as LLMEngine.add_request does (and its front end); its choice 0."""
    group = SequenceGroup(request_id, params.prompt_logprobs is not None, ())
    for index in range(params.n):
        Sequence(request_id, PROMPT, params, None, 0, index=index, group=group)
    processor.add(group.seqs[0])
    processor.scheduler.add(group.seqs[0])
    processor.texts.add(request_id, params)
    return group.seqs[0]


def engine_step(processor: OutputProcessor, *tokens: int | SampleFailure) -> list[RequestOutput]:
    """Schedule, and give every row of the batch `tokens` (one per choice it samples): the engine's outputs."""
    batch = processor.scheduler.schedule()
    results = {i: SeqResult(done=True, tokens=list(tokens), logprobs=[None] * len(tokens))
               for i in range(len(batch.seqs))}
    return processor.postprocess(batch, results)


def step(processor: OutputProcessor, *tokens: int | SampleFailure) -> list[RequestOutput]:
    """engine_step's outputs as the front end gives them: with their text."""
    return processor.texts.apply(engine_step(processor, *tokens))


def test_tokens_become_text_until_max_tokens(processor):
    add(processor, "r", SamplingParams(max_tokens=3, temperature=0.0))
    outs = [step(processor, t)[0] for t in (LO, WOR, LD)]
    assert [o.text for o in outs] == ["lo", "lo wor", "lo world"]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].token_ids == [LO, WOR, LD] and outs[-1].finish_reason == "length"
    assert not processor.seqs and not processor.scheduler.has_unfinished()


def test_eos_stops_unless_ignored(processor):
    add(processor, "stops", SamplingParams(max_tokens=8))
    add(processor, "goes_on", SamplingParams(max_tokens=8, ignore_eos=True))
    outs = {o.request_id: o for o in step(processor, EOS)}
    assert outs["stops"].finish_reason == "stop" and outs["stops"].finished
    assert not outs["goes_on"].finished and outs["goes_on"].token_ids == [EOS]
    assert list(processor.seqs) == ["goes_on"]


def test_stop_string_is_cut_and_never_streamed(processor):
    add(processor, "r", SamplingParams(max_tokens=8, stop=["stop"]))
    outs = [step(processor, t)[0] for t in (LO, DOT, ST, O)]
    # "st", then "sto", could still become "stop": held back, never streamed.
    assert [o.text for o in outs] == ["lo", "lo.", "lo. ", "lo. "]
    last = step(processor, P)[0]
    assert last.text == "lo. " and last.finish_reason == "stop" and last.finished
    assert last.token_ids == [LO, DOT, ST, O, P]  # usage: up to the token that completed the stop
    # The front end aborted the request in the engine; the engine's abort output is not given again.
    assert not processor.seqs and not processor.scheduler.has_unfinished()
    assert processor.texts.apply(processor.postprocess(processor.scheduler.schedule(), {})) == []


def test_the_engines_outputs_carry_no_text(processor):
    """Detokenizing and stop strings are the front end's (server.engine.output_text), off the engine's
    step: an engine output with text would mean that work came back into the step."""
    add(processor, "r", SamplingParams(max_tokens=3, stop=["world"]))
    outs = [engine_step(processor, t)[0] for t in (LO, WOR, LD)]
    assert [o.text for o in outs] == ["", "", ""]
    assert outs[-1].finish_reason == "length"  # the stop string is not the engine's to find


def test_a_stop_string_inside_a_run_of_tokens_ends_at_its_token(processor):
    """Several tokens in one output (a verified speculative run, or a consumer that fell behind): the
    stop ends the choice at the token that completed it; later tokens and their logprobs are dropped."""
    add(processor, "r", SamplingParams(max_tokens=8, stop=[" wor"]))
    out = engine_step(processor, LO)[0]
    out.token_ids += [WOR, LD]  # as the engine's next outputs would accumulate them
    out.logprobs = [None, None, None]
    texted, = processor.texts.apply([out])
    assert (texted.text, texted.token_ids, texted.finish_reason) == ("lo", [LO, WOR], "stop")
    assert texted.logprobs == [None, None]


def test_min_tokens_keeps_a_stop_string_inside_them(processor):
    add(processor, "r", SamplingParams(max_tokens=4, min_tokens=2, stop=["lo"], ignore_eos=True))
    outs = [step(processor, t)[0] for t in (LO, WOR, LO)]
    assert [o.text for o in outs] == ["lo", "lo wor", "lo wor"]
    assert outs[-1].finish_reason == "stop" and outs[-1].token_ids == [LO, WOR, LO]


def test_max_model_len_ends_a_choice(processor):
    add(processor, "r", SamplingParams(max_tokens=100, ignore_eos=True))
    outs = [step(processor, LO)[0] for _ in range(MAX_MODEL_LEN - len(PROMPT))]
    assert outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])


def test_a_sample_failure_fails_only_its_request(processor):
    add(processor, "r", SamplingParams(max_tokens=4))
    out, = step(processor, SampleFailure("produced non-finite logits", non_finite=True))
    assert out.finish_reason == "error" and out.error == "the base model produced non-finite logits"
    assert not processor.seqs


def test_abort_is_reported_by_the_next_step(processor):
    add(processor, "r", SamplingParams(max_tokens=4))
    step(processor, LO)
    processor.abort("r")
    processor.abort("r")  # already gone: nothing more
    assert not processor.seqs and len(processor.aborted) == 1
    out, = processor.postprocess(processor.scheduler.schedule(), {})
    assert out.finish_reason == "abort" and out.token_ids == [LO] and not processor.aborted


def test_n_choices_fork_after_the_prompt(processor):
    add(processor, "r", SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=0))
    first = step(processor, LO, WOR)
    assert [(o.index, o.text) for o in first] == [(0, "lo"), (1, " wor")]
    second = step(processor, LD)  # each choice its own row now
    assert [(o.index, o.text, o.finished) for o in second] == [(0, "lold", True), (1, " world", True)]
    assert not processor.seqs


def test_a_failed_adapter_load_fails_its_request(processor):
    seq = add(processor, "r", SamplingParams(max_tokens=4))
    batch = processor.scheduler.schedule()
    batch.failed.append((seq, "no such version"))
    outs = processor.postprocess(batch, {0: SeqResult(done=True, tokens=[LO], logprobs=[None])})
    assert outs[0].finish_reason == "error" and "could not be loaded: no such version" in outs[0].error


def test_a_stop_string_ends_one_choice_and_the_request_ends_with_the_last(processor):
    add(processor, "r", SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=0, stop=["lo"]))
    first = step(processor, LO, WOR)
    assert [(o.index, o.text, o.finished, o.finish_reason) for o in first] == [(0, "", True, "stop"),
                                                                               (1, " wor", False, None)]
    assert "r" in processor.seqs  # choice 1 runs on; the engine still runs choice 0 too, unseen
    second = step(processor, LD)  # choice 0's engine output is dropped
    assert [(o.index, o.text, o.finished) for o in second] == [(1, " world", False)]
    batch = processor.scheduler.schedule()  # choice 1 draws EOS; choice 0, still running in the engine, not
    results = {i: SeqResult(done=True, tokens=[EOS if seq.index else DOT], logprobs=[None])
               for i, seq in enumerate(batch.seqs)}
    third = processor.texts.apply(processor.postprocess(batch, results))
    assert [(o.index, o.text, o.finish_reason) for o in third] == [(1, " world", "stop")]
    # Every choice ended here: the front end aborted the request, so choice 0 left the engine too.
    assert not processor.seqs and not processor.scheduler.has_unfinished()
    assert processor.texts.apply(processor.postprocess(processor.scheduler.schedule(), {})) == []
