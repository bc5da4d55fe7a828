"""Schema-driven fuzzing: schemathesis generates requests from /openapi.json (bounded, seeded) and
checks every answer: no 5xx, only documented status codes and media types, bodies that match the
published response schemas."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 12  # per operation; seeded (derandomize), so a run is repeatable


def _credentials(api_server, tiny_adapters) -> dict:
    _, key = api_server.new_tenant()
    assert api_server.upload(key, "fz", tiny_adapters["r4_qv"]).status_code == 201
    return {"tenant": key, "admin": api_server.config.admin_token}


def _shorten(case) -> None:
    """Keep generations short: the point is validation and response shapes, not decoding."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4


def test_every_operation_keeps_its_schema(api_server, tiny_adapters):
    creds = _credentials(api_server, tiny_adapters)
    loaded = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    operations = [result.ok() for result in loaded.get_all_operations()]
    assert len(operations) >= 19
    for operation in operations:
        if operation.method.upper() == "DELETE" and operation.path.startswith("/admin/tenants/"):
            continue  # deleting the fuzzing tenant itself would only test that it is gone afterwards
        admin = operation.path.startswith(("/admin", "/metrics"))
        headers = {"Authorization": f"Bearer {creds['admin' if admin else 'tenant']}"}

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            _shorten(case)
            case.call_and_validate(base_url=api_server.url, headers=headers, checks=CHECKS, timeout=60)

        call()
    assert api_server.state.engine.is_healthy
