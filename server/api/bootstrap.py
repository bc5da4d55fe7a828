"""Start-up writes: the built-in tenants, the demo key, and preloaded adapters."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapters.format import CONFIG_FILE, WEIGHTS_FILE, inspect_adapter_bytes
from server.api.state import ServerState

DEFAULT_TENANT = "default"
DEMO_TENANT = "demo"


@dataclass(frozen=True)
class StartupInfo:
    base_url: str
    model_id: str
    admin_token: str
    admin_token_generated: bool
    demo_tenant: str | None
    demo_key: str | None
    demo_adapters: tuple[str, ...]

    def curl_line(self) -> str:
        body = f'{{"model": "{self.model_id}", "prompt": "Once upon a time", "max_tokens": 16}}'
        return (f"curl -s {self.base_url}/v1/completions -H 'Authorization: Bearer {self.demo_key}' "
                f"-H 'Content-Type: application/json' -d '{body}'")


def _put_dir(state: ServerState, tenant: str, name: str, directory: str | Path) -> None:
    """Store a PEFT directory under the tenant unless the same bytes are already there."""
    d = Path(directory)
    config_json = (d / CONFIG_FILE).read_bytes()
    weights = (d / WEIGHTS_FILE).read_bytes()
    summary = inspect_adapter_bytes(config_json, weights, state.engine.engine.adapter_shape,
                                    state.config.max_lora_rank)
    existing = state.registry.get(tenant, name)
    if existing is not None and state.registry.read_files(existing.version) == (config_json, weights):
        return
    state.registry.put(tenant, name, config_json, weights, summary=summary, replace=True)


def bootstrap(state: ServerState, base_url: str) -> StartupInfo:
    """Blocking (Redis and file reads): run it off the event loop."""
    cfg = state.config
    state.tenants.ensure(DEFAULT_TENANT)
    for name, directory in cfg.adapters:
        _put_dir(state, DEFAULT_TENANT, name, directory)
    demo_key = None
    demo_adapters: tuple[str, ...] = ()
    if cfg.demo_tenant:
        state.tenants.ensure(DEMO_TENANT)
        _, demo_key = state.tenants.create_key(DEMO_TENANT)
        if state.demo is not None:
            for name, directory in state.demo.adapters.items():
                _put_dir(state, DEMO_TENANT, name, directory)
            demo_adapters = tuple(state.demo.adapters)
    return StartupInfo(base_url=base_url, model_id=state.model_id, admin_token=cfg.admin_token,
                       admin_token_generated=cfg.admin_token_generated,
                       demo_tenant=DEMO_TENANT if cfg.demo_tenant else None, demo_key=demo_key,
                       demo_adapters=demo_adapters)
