"""The real-model evaluation (benchmarks/eval/eval_real_model.py): its items file is what the generator writes,
its checks tell each effect from its absence, and a 20-item slice on SmolLM2 with the shipped demo
adapters gives the same tokens over HTTP as transformers + peft, with the adapters' effects showing.
The full evaluation is a benchmark (docs/benchmarks/eval-real-model.md), not a test; the slice runs
with LORAPLEX_REAL_EVAL=1."""
from __future__ import annotations

import os

import pytest

from benchmarks.eval.eval_checks import is_correct, is_french, is_json, is_pirate
from server import default_model
from server.bench.eval_items import EvalItem, build_items, load_items
from server.config import ServerConfig
from server.default_model import DefaultModelMissing
from server.embedded_redis.server import free_port
from server.model_source import SHIPPED_ADAPTERS
from tests.fixtures_server import ADMIN_TOKEN, api_redis_url, running_server


def test_the_items_file_is_what_the_generator_writes():
    items = load_items()
    assert items == build_items() and len(items) == 269
    assert len({i.id for i in items}) == len(items)


def test_the_effect_checks_tell_each_style_from_plain_english():
    english = ["The capital of France is Paris.", "5 + 7 = 12", "A spider has 8 legs.", '{"answer": "Paris"} is it']
    assert not any(is_french(t) or is_json(t) or is_pirate(t) for t in english)
    assert all(is_french(t) for t in ["La capitale de l'Italie est Rome.", "12 plus 7 font 19.",
                                      "Une araignée a 8 pattes."])
    assert all(is_json(t) for t in ['{"answer": "Rome"}', '```json\n{"answer": 19}\n```'])
    assert not is_json('["Rome"]')
    assert is_pirate("Arr, the capital of Italy be Rome, matey!") and not is_pirate("Arrows are sharp.")


@pytest.mark.parametrize(("check", "expect", "good", "bad"), [
    ("contains", ("12",), "5 plus 7 is 12.", "5 plus 7 is 125."),
    ("contains", ("Mexico City", "Mexico"), "It is Mexico City.", "It is Mexicali."),
    ("one_word", ("Rome",), "Rome.", "The capital is Rome."),
    ("only_number", ("19",), "19", "The answer is 19."),
    ("upper", ("HELLO",), "HELLO", "Hello"),
    ("json_answer", ("Rome",), '{"answer": "Rome"}', "Rome"),
    ("comma_list", ("3",), "red, green, blue", "red and green"),
])
def test_each_correctness_check_accepts_the_right_reply_only(check, expect, good, bad):
    item = EvalItem("x-000", "format", "q?", check, expect, False)
    assert is_correct(item, good) and not is_correct(item, bad)


@pytest.fixture(scope="module")
def smol_with_adapters(request, redis_server):
    if not os.environ.get("LORAPLEX_REAL_EVAL"):
        # 303 s with LORAPLEX_REAL_EVAL=1 on the shared 2-core machine (load ~12): a server start and 60
        # generations each side, one request at a time
        pytest.skip("the real-model slice takes over a minute here: run python -m benchmarks.eval.eval_real_model "
                    "--limit 20, or set LORAPLEX_REAL_EVAL=1 to run this test")
    try:
        default_model.packaged_gguf()
    except DefaultModelMissing as e:
        pytest.skip(f"{e}; the real-model evaluation is benchmarks/eval/eval_real_model.py")
    if not (SHIPPED_ADAPTERS / "french").is_dir():
        pytest.skip(f"no demo adapters in {SHIPPED_ADAPTERS}; scripts/train_demo_adapters.py makes them")
    data_dir = request.config.cache.mkdir("loraplex-default-model")  # shares test_default_model's conversion
    config = ServerConfig.of(data_dir=data_dir, admin_token=ADMIN_TOKEN, redis_url=api_redis_url(redis_server),
                             port=free_port(), device="cpu", dtype="float32", max_lora_rank=8, max_loras=4)
    with running_server(config, timeout=600) as handle:
        yield handle


def test_a_20_item_slice_agrees_with_peft_and_shows_the_adapters_effects(smol_with_adapters):
    from benchmarks.eval.eval_http import http_replies
    from benchmarks.eval.eval_peft import peft_replies
    from benchmarks.eval.eval_real_model import spread
    from benchmarks.eval.eval_report import agreement, score

    srv = smol_with_adapters
    info = srv.app.state.startup
    assert set(info.demo_adapters) >= {"french", "json"}  # the shipped adapters went to the demo tenant
    items = spread(load_items(), 20)
    models = [info.model_id, "french", "json"]
    # one request at a time: every reply computed in batches of the same shape on every run
    http = http_replies(srv.url, info.demo_key, models, items, max_tokens=24, concurrency=1)
    demo = srv.state.demo
    assert demo.adapters["french"] == SHIPPED_ADAPTERS / "french"
    oracle = peft_replies(demo.model_dir, demo.adapters, models, items, max_tokens=24, base_name=info.model_id)
    agree = agreement(items, http, oracle)
    assert agree["all"] == 1.0, agree["mismatches"]
    scores = score(items, http)
    assert scores["french"]["effects"]["french"] >= 0.8 and scores[info.model_id]["effects"]["french"] == 0.0
    assert scores["json"]["effects"]["json"] >= 0.8 and scores[info.model_id]["effects"]["json"] == 0.0
