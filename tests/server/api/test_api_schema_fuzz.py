"""Schema-driven fuzzing: schemathesis (its own runner, as `st run`) generates requests from
/openapi.json, bounded and seeded, in its coverage phase (boundary values, missing and wrong-typed
fields, undeclared methods, missing credentials) and its fuzzing phase, and holds every answer to the
document: no 5xx; only documented status codes, media types and headers; bodies that match the published
response schemas; every schema-violating request refused; schema-valid requests accepted; a 405 whose
`Allow` lists the path's methods. The run must end with no failure of any check."""
from __future__ import annotations

import subprocess
import sys

import httpx

EXAMPLES = 5  # per operation in the fuzzing phase; seeded, so a run is repeatable
# Bodies whose validity a JSON schema cannot say in full, so "schema-valid yet refused" is expected
# there: every value must keep the body's bounds (integers of at most 24 digits, nesting at most 32:
# docs/limits-and-isolation.md; unknown fields are refused, as published); the generation
# endpoints also refuse prompts longer than the context, vLLM fields we know but do not implement unless
# left at their defaults, and combinations such as stream_options without stream; an adapter upload must
# be a PEFT config and safetensors that fit the base model. Everything else (query parameters, the
# PATCH body, which takes no unknown field) must be accepted whenever it is schema-valid.
SEMANTIC_REFUSALS = ("^post__(v1_(chat_completions|completions|adapters)|tokenize|detokenize|admin_tenants"
                     "|admin_tenants_.name._adapters)$")  # operationIds


def _config(api_server, tiny_adapters, path) -> None:
    _, key = api_server.new_tenant()
    assert api_server.upload(key, "fz", tiny_adapters["r4_qv"]).status_code == 201
    admin = api_server.config.admin_token
    path.write_text(f'''
seed = 1
continue-on-failure = true
request-timeout = 60
suppress-health-check = ["all"]
[checks]
enabled = true
[phases.examples]
enabled = false
[phases.coverage]
enabled = true
[phases.fuzzing]
enabled = true
[phases.stateful]
enabled = false
[generation]
max-examples = {EXAMPLES}

[[operations]]
include-path-regex = "^/(v1|tokenize|detokenize)"
headers = {{ Authorization = "Bearer {key}" }}

[[operations]]
include-path-regex = "^/(admin|metrics|health|version|openapi)"
headers = {{ Authorization = "Bearer {admin}" }}

[[operations]]
include-operation-id-regex = "{SEMANTIC_REFUSALS}"
checks.positive_data_acceptance.enabled = false

# Deleting the fuzzing tenant itself would only test that it is gone afterwards.
[[operations]]
include-operation-id = "delete__admin_tenants_{{name}}"
enabled = false
''')


def test_every_operation_keeps_its_schema(api_server, tiny_adapters, tmp_path):
    config = tmp_path / "schemathesis.toml"
    _config(api_server, tiny_adapters, config)
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--no-color", "--config-file", str(config),
                          "run", f"{api_server.url}/openapi.json", "--workers", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    doc = httpx.get(f"{api_server.url}/openapi.json").json()
    total = sum(method in ("get", "put", "post", "patch", "delete") for ops in doc["paths"].values() for method in ops)
    # Every published operation but the one the config leaves out is exercised.
    assert f"Operations:       {total - 1} selected / {total} total" in report and "passed" in report, report
    assert api_server.state.engine.is_healthy
