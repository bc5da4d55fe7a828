"""OutputProcessor (server.engine.output_processor) on its own: a real scheduler and sequences, and
hand-made step results in place of the model's; its outputs' text made as a front end makes it
(server.engine.output_text's OutputTexts, the LLM API's)."""
from __future__ import annotations

import pytest

from adapters.host_tier import HostTier
from server.engine.block_manager import BlockManager
from server.engine.choice_abort import ChoiceAbort
from server.engine.lora.slots import LoraSlots
from server.engine.model_runner import SeqResult, TokenResults
from server.engine.output_processor import OutputProcessor
from server.engine.output_text import IncrementalDetokenizer, OutputTexts
from server.engine.sampler import SampleFailure
from server.engine.scheduler import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST, Scheduler, SchedulerLimits
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
    processor.texts = OutputTexts(IncrementalDetokenizer(tokenizer), processor.abort_choice)  # the front end's
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


def test_a_stop_string_ends_its_choice_in_the_engine_and_the_other_runs_on(processor):
    add(processor, "r", SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=0, stop=["lo"]))
    first = step(processor, LO, WOR)
    assert [(o.index, o.text, o.finished, o.finish_reason) for o in first] == [(0, "", True, "stop"),
                                                                               (1, " wor", False, None)]
    choice0, choice1 = processor.seqs["r"].group.seqs  # choice 1 runs on
    assert choice0.finished and not choice1.finished, "the front end aborted choice 0 alone"
    assert processor.scheduler.running == [choice1]
    second = step(processor, LD)  # one row: choice 1's (choice 0's abort output is dropped)
    assert [(o.index, o.text, o.finished) for o in second] == [(1, " world", False)]
    assert choice0.token_ids == PROMPT + [LO], "choice 0 ran no step past its stop"
    third = step(processor, EOS)
    assert [(o.index, o.text, o.finish_reason) for o in third] == [(1, " world", "stop")]
    assert not processor.seqs and not processor.scheduler.has_unfinished()
    assert processor.texts.apply(processor.postprocess(processor.scheduler.schedule(), {})) == []


def test_tokens_run_past_a_stop_string_are_taken_back_from_the_fair_share(processor):
    """The engine ran a step more before the front end's abort came: that token is not charged."""
    add(processor, "r", SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=0, stop=["lo"]))
    counters = processor.scheduler.waiting.counters
    early = engine_step(processor, LO, WOR)
    late = engine_step(processor, LD)  # choice 0's "ld" too: its front end has not read "lo" yet
    choice0 = processor.seqs["r"].group.seqs[0]
    assert choice0.num_output_tokens == 2
    assert counters[None] == len(PROMPT) * PROMPT_TOKEN_COST + 4 * OUTPUT_TOKEN_COST
    assert [o.finish_reason for o in processor.texts.apply(early)] == ["stop", None]  # ChoiceAbort(kept=1)
    assert choice0.finished
    # Choice 0's one token and choice 1's two: what the clients were given.
    assert counters[None] == len(PROMPT) * PROMPT_TOKEN_COST + 3 * OUTPUT_TOKEN_COST
    assert [(o.index, o.text) for o in processor.texts.apply(late)] == [(1, " world")]


def test_a_choice_abort_after_the_request_ended_in_the_engine_still_takes_its_tokens_back(processor):
    add(processor, "r", SamplingParams(max_tokens=2, temperature=0.0, stop=["lo"]))
    outs = engine_step(processor, LO) + engine_step(processor, WOR)  # "length" before the front end read "lo"
    assert not processor.seqs and outs[-1].finish_reason == "length"
    counters = processor.scheduler.waiting.counters
    assert counters[None] == len(PROMPT) * PROMPT_TOKEN_COST + 2 * OUTPUT_TOKEN_COST
    texted = processor.texts.apply(outs)
    assert [(o.text, o.finish_reason, o.token_ids) for o in texted] == [("", "stop", [LO])]
    assert counters[None] == len(PROMPT) * PROMPT_TOKEN_COST + 1 * OUTPUT_TOKEN_COST
    processor.abort_choice(ChoiceAbort("r", 0, 0))  # told twice, or for an index it never had: nothing
    processor.abort_choice(ChoiceAbort("r", 5, 0))
    processor.abort_choice(ChoiceAbort("unknown", 0, 0))
    assert counters[None] == len(PROMPT) * PROMPT_TOKEN_COST + 1 * OUTPUT_TOKEN_COST


def _run_plain_rows(processor: OutputProcessor, shared: bool) -> tuple[list, dict, list, list]:
    """Requests of three tenants (one weighted) that end by EOS, a stop id, min_tokens, max_tokens and the
    model's length, run to the end with each step's one-token results given as the runner gives a plain
    row's (`shared`: TokenResults, which post-processing appends inline) or as a general SeqResult."""
    processor.scheduler.waiting.set_weight("heavy", 3.0)
    cases = {"eos": SamplingParams(max_tokens=9), "stop_id": SamplingParams(max_tokens=9, stop_token_ids=(DOT,)),
             "min": SamplingParams(max_tokens=9, min_tokens=3), "max": SamplingParams(max_tokens=5, ignore_eos=True),
             "len": SamplingParams(max_tokens=100, ignore_eos=True)}
    seqs = []
    for k, (rid, params) in enumerate(cases.items()):
        group = SequenceGroup(rid, False, ())
        seq = Sequence(rid, PROMPT, params, None, k, tenant=("heavy", "a", None)[k % 3], group=group)
        processor.add(seq)
        processor.scheduler.add(seq)
        seqs.append(seq)
    script = {"eos": [LO, WOR, EOS], "stop_id": [LO, DOT], "min": [EOS, EOS, EOS, LO]}

    def pick(seq: Sequence) -> int:
        k, row = seq.num_output_tokens, script.get(seq.request_id)
        return row[min(k, len(row) - 1)] if row else (LD if k % 2 else LO)

    made, steps = TokenResults(), []
    while processor.scheduler.has_unfinished():
        batch = processor.scheduler.schedule()
        picks = [pick(s) for s in batch.seqs]
        results = {i: made[t] if shared else SeqResult(done=True, tokens=[t], logprobs=[None])
                   for i, t in enumerate(picks)}
        outs = processor.postprocess(batch, results)
        steps.append([(o.request_id, o.token_ids, o.finished, o.finish_reason) for o in outs])
    return steps, dict(processor.scheduler.waiting.counters), [s.num_registered_blocks for s in seqs], \
        [s.block_hashes for s in seqs]


def test_a_plain_rows_token_is_appended_inline_as_the_general_path_does():
    """The inline path for a row that got its token and nothing more (TokenResults) gives the general
    path's outputs, finish reasons, fair-share counters and prefix-cache registrations, to the bit."""
    def fresh() -> OutputProcessor:
        blocks = BlockManager(num_blocks=32, block_size=4)
        scheduler = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64), blocks, LoraSlots([], 1),
                              HostTier(None, None))
        return OutputProcessor(scheduler, frozenset({EOS}), MAX_MODEL_LEN)

    general, inline = _run_plain_rows(fresh(), shared=False), _run_plain_rows(fresh(), shared=True)
    assert inline == general
    steps, counters, registered, hashes = inline
    assert {o[3] for outs in steps for o in outs if o[2]} == {"stop", "length"}
    assert counters["heavy"] != counters["a"] and all(registered) and all(hashes)
