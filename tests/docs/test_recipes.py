"""docs/recipes.md runs as written (issue 25): each recipe block is executed against a real server (real
redis, uvicorn) with BASE, KEY, MODEL and TOKENIZER set as the doc says. lm-eval and aiperf run when they
are installed (on PATH) and skip with a message otherwise."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures_server import ServerHandle, api_redis_url, running_server, server_config
from tests.repo import ROOT_DIR as ROOT

RECIPES = (ROOT / "docs" / "recipes.md").read_text()
METRICS_TOKEN = "recipe-metrics-token-0123456789"


def recipe(name: str) -> tuple[str, str]:
    """(language, code) of the block marked `<!-- recipe: name -->`."""
    m = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```(\w+)\n(.*?)```", RECIPES, re.S)
    assert m, f"docs/recipes.md has no recipe {name!r}"
    return m.group(1), m.group(2)


@pytest.fixture(scope="module")
def recipe_server(tmp_path_factory, tiny_model_dir, redis_server, core_starter) -> Iterator[ServerHandle]:
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("recipe-data"),
                           api_redis_url(redis_server, flush=False), redis_prefix="lp-recipes:",
                           metrics_token=METRICS_TOKEN, max_model_len=256)
    with running_server(config, starter=core_starter) as handle:
        yield handle


@pytest.fixture(scope="module")
def recipe_env(recipe_server, tiny_model_dir, tiny_adapters, tmp_path_factory) -> dict[str, str]:
    """The doc's variables, with MODEL an adapter: every recipe runs through the LoRA path."""
    _, key = recipe_server.new_tenant()
    assert recipe_server.upload(key, "sql", tiny_adapters["r8_all"]).status_code == 201
    home = tmp_path_factory.mktemp("home")
    return {**os.environ, "BASE": recipe_server.url, "KEY": key, "MODEL": "sql", "TOKENIZER": str(tiny_model_dir),
            "METRICS_TOKEN": METRICS_TOKEN, "HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def run(name: str, env: dict[str, str], cwd: Path, code: str | None = None, timeout: int = 300):
    lang, text = recipe(name)
    text = code if code is not None else text
    cmd = ["bash", "-euc", text] if lang == "bash" else [sys.executable, "-c", text]
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(recipe_env, tmp_path):
    body = json.loads(run("curl", recipe_env, tmp_path).stdout)
    assert body["model"] == "sql" and body["usage"]["completion_tokens"] == 8


def test_openai_client(recipe_env, tmp_path):
    out = run("openai", recipe_env, tmp_path).stdout
    assert "completion_tokens=8" in out  # the streamed usage chunk


def test_langchain(recipe_env, tmp_path):
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    out = run("langchain", recipe_env, tmp_path).stdout
    assert out.strip()


SMOKE_TASK = """task: loraplex_smoke
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions(recipe_env, tmp_path, tiny_model_dir, hf_logprobs):
    if shutil.which("lm_eval", path=recipe_env["PATH"]) is None:
        pytest.skip('lm-eval is not installed (pip install "lm-eval[api]"): its recipe did not run')
    # No dataset hub here: the doc's task is swapped for a local one of the same kind (multiple choice).
    data = tmp_path / "smoke.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": ["yes", "no"], "label": 0}) + "\n"
                            for q in ("Is fire hot?", "Is water wet?", "Is the sky up?")))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "loraplex_smoke.yaml").write_text(SMOKE_TASK.format(data=data))
    _, text = recipe("lm-eval")
    assert "add_bos_token=True" in text
    text = text.replace("--tasks arc_easy --limit 20", f"--tasks loraplex_smoke --include_path {tasks} "
                                                      f"--log_samples --output_path {tmp_path / 'out'}")
    out = run("lm-eval", recipe_env, tmp_path, code=text, timeout=600)
    assert re.search(r"loraplex_smoke\s*\|", out.stdout), out.stdout + out.stderr
    # Each log-likelihood lm-eval got is PEFT's for the text with the tokenizer's BOS in front.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = [json.loads(line) for p in (tmp_path / "out").rglob("samples_loraplex_smoke_*.jsonl")
               for line in p.read_text().splitlines()]
    pairs = []
    for sample in samples:
        # lm-eval logs each request's arguments as {"gen_args_0": {"arg_0": context, "arg_1": continuation}}
        args = sample["arguments"]
        args = [list(a.values()) for a in args.values()] if isinstance(args, dict) else args
        pairs += [(a[0], a[1], float(resp[0][0])) for a, resp in zip(args, sample["resps"])]
    assert len(pairs) == 6, samples
    for context, continuation, loglik in pairs:
        whole = tok(context + continuation).input_ids
        assert whole[0] == tok.bos_token_id
        start = len(tok(context).input_ids)
        logprobs = hf_logprobs("r8_all", whole)  # [L, V]
        expected = sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))
        assert abs(loglik - expected) < 1e-4, (context, continuation, loglik, expected)


def test_aiperf(recipe_env, tmp_path):
    if shutil.which("aiperf", path=recipe_env["PATH"]) is None:
        pytest.skip("aiperf is not installed (pip install aiperf): its recipe did not run")
    # Not HF_HUB_OFFLINE: aiperf's offline mode looks a local tokenizer directory up in the hub cache.
    env = {k: v for k, v in recipe_env.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    out = run("aiperf", env, tmp_path, timeout=600)
    exports = list(tmp_path.rglob("profile_export_aiperf.json"))
    assert exports, out.stdout + out.stderr
    report = json.loads(exports[0].read_text())
    # the token reached /metrics: aiperf exported what it scraped from loraplex
    scraped = "".join(p.read_text() for p in tmp_path.rglob("*server_metrics*.json*"))
    assert "loraplex_" in scraped, sorted(str(p) for p in tmp_path.rglob("*"))[:50]
    assert report["request_count"]["avg"] == 8, report.get("request_count")


def test_metrics_take_the_token_as_a_basic_password(recipe_server):
    """What the aiperf recipe relies on: scrapers that send no bearer token can send HTTP Basic."""
    url = f"{recipe_server.url}/metrics"
    assert httpx.get(url, auth=("metrics", METRICS_TOKEN)).status_code == 200
    assert httpx.get(url, auth=("metrics", "wrong-token")).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Basic !!not-base64"}).status_code == 401
    assert httpx.get(url).status_code == 401
