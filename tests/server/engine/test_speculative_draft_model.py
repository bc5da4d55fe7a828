"""Speculative decoding with a draft model: the same tokens as the plain engine.

Two drafts of the tiny model: the tiny model itself (its greedy base rows accept every draft, so long
accepted runs, and stops inside them, are exercised) and a smaller random model with the same
vocabulary (drafts rarely accepted). Mixed batches of base and adapter rows, greedy and seeded, through
preemption (the draft's KV rebuilt) and prefix-cache hits; a draft of another vocabulary, or of an
architecture the engine does not serve, is refused at start in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.demo import make_base_model
from server.engine import LLM, SamplingParams
from server.engine.config import ModelConfigError
from server.engine.speculative_config import parse_speculative_config
from tests.server.engine.test_speculative_medusa import check_mixed_batch, prompts_of
from tests.server.engine.test_speculative_ngram import assert_same

pytestmark = pytest.mark.unit

VOCAB = 512
OPTS = dict(device="cpu", dtype="float32", max_loras=4, max_model_len=256, max_num_batched_tokens=64, block_size=16,
            kernels="torch")


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> Path:
    """A smaller random llama with the tiny model's vocabulary: one layer, hidden 32."""
    return make_base_model(tmp_path_factory.mktemp("other-draft"), "llama", hidden_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, intermediate_size=64, seed=7)


def spec(draft: Path, k: int = 4) -> dict:
    # disable_by_batch_size past the batches here: every step speculates.
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "disable_by_batch_size": 64}


def pair(model_dir, adapters, draft: Path, **kw) -> tuple[LLM, LLM]:
    llms = LLM(model_dir, **OPTS, **kw), LLM(model_dir, speculative_config=spec(draft), **OPTS, **kw)
    for llm in llms:
        llm.add_adapter("r8_all", adapters["r8_all"])
        llm.add_adapter("r4_qv", adapters["r4_qv"])
    return llms


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("which", ["same", "other"])
def test_mixed_batch_matches_plain_engine_through_preemption_and_prefix_hits(tiny_model_dir, tiny_adapters,
                                                                             other_draft, sampled, which):
    draft = tiny_model_dir if which == "same" else other_draft
    plain, drafted = pair(tiny_model_dir, tiny_adapters, draft, kv_cache_blocks=20)
    processor = check_mixed_batch(plain, drafted, sampled)
    if which == "same" and not sampled:
        assert processor.num_accepted_tokens > 0, "no draft was accepted: the test shows nothing"
    assert not drafted.engine.scheduler.draft_model.states, "finished sequences' draft state is dropped"


def test_own_draft_is_accepted_on_greedy_base_rows_through_preemption(tiny_model_dir, tiny_adapters):
    """The model as its own draft proposes the target's greedy tokens: (nearly) every draft accepted, also
    after a preemption, so the draft's KV of a preempted sequence is rebuilt, not read stale."""
    plain, drafted = pair(tiny_model_dir, tiny_adapters, tiny_model_dir, kv_cache_blocks=16)
    prompts = prompts_of(10, seed=11)
    p = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    assert_same(plain.generate(prompts, p), drafted.generate(prompts, p))
    assert drafted.engine.stats().scheduler.preemptions > 0
    counters = drafted.engine.scheduler.spec_counters.snapshot()
    assert counters.num_accepted_tokens >= 0.9 * counters.num_draft_tokens > 0


def test_stops_inside_an_accepted_run_cut_where_the_plain_engine_stops(tiny_model_dir, tiny_adapters):
    plain, drafted = pair(tiny_model_dir, tiny_adapters, tiny_model_dir, kv_cache_blocks=128)
    prompts = prompts_of(4, seed=5)
    free = plain.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                          adapters=[None, "r8_all"] * 2)
    ps = []
    for out in free:  # a stop token, a stop text the free run reaches after a few tokens, an odd max_tokens
        ps.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[out.token_ids[9]]))
        ps.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                 stop=[out.text[len(out.text) // 2:][:3]]))
        ps.append(SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    repeated = [p for p in prompts for _ in range(3)]
    names = [n for n in [None, "r8_all"] * 2 for _ in range(3)]
    outs = [llm.generate(repeated, ps, adapters=names) for llm in (plain, drafted)]
    assert_same(*outs)
    assert drafted.engine.output_processor.num_accepted_tokens > 0


def test_draft_of_another_vocabulary_is_refused_naming_both_sizes(tiny_model_dir, tmp_path):
    small = make_base_model(tmp_path / "v384", "llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, vocab_size=384)
    want = json.loads((small / "config.json").read_text())["vocab_size"]
    with pytest.raises(ModelConfigError) as e:
        LLM(tiny_model_dir, speculative_config=spec(small), **OPTS)
    message = str(e.value)
    assert "\n" not in message and f"({want} tokens)" in message and f"({VOCAB} tokens)" in message


def test_serve_refuses_a_draft_of_another_vocabulary_in_one_line_before_the_model_loads(tiny_model_dir, tmp_path):
    from server.cli import build_parser, prepare_model
    from server.config import ConfigError, ServerConfig

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({**json.loads((tiny_model_dir / "config.json").read_text()),
                                                   "vocab_size": 1000}))
    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"),
                                      "--admin-token", "x" * 16, "--speculative-config", json.dumps(spec(draft))])
    with pytest.raises(ConfigError) as e:
        prepare_model(ServerConfig.from_args(args, env={}))
    assert str(e.value) == ("--speculative-config: speculative draft model's vocabulary (1000 tokens) does not "
                            f"match the target's ({VOCAB} tokens)")


def test_a_target_windowed_in_every_layer_is_refused_naming_its_window(tiny_model_dir, tmp_path):
    from server.engine.config import ModelConfig
    from server.engine.draft_model_loader import read_draft_config

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    target = ModelConfig.from_dict({**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                    "sliding_window": 64})
    with pytest.raises(ModelConfigError, match="sliding window in every layer .*window 64"):
        read_draft_config(str(tiny_model_dir), target)


def test_draft_of_an_architecture_not_served_is_refused(tiny_model_dir, tmp_path):
    draft = tmp_path / "gpt2"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": VOCAB}))
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        LLM(tiny_model_dir, speculative_config=spec(draft), **OPTS)
    with pytest.raises(ModelConfigError, match="no config.json"):
        LLM(tiny_model_dir, speculative_config=spec(tmp_path / "missing"), **OPTS)


@pytest.mark.parametrize(("value", "error"), [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative method draft_model needs \"model\""),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "'prompt_lookup_max' is not supported by method draft_model"),
])
def test_config_refusals(value, error):
    with pytest.raises(ValueError, match=error):
        parse_speculative_config(value)


def test_config_reads_model_and_k():
    config = parse_speculative_config({"method": "draft_model", "model": "d", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "d", 3)
