"""Start-up writes: the built-in tenants, the demo key, and preloaded adapters."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from adapters.format import CONFIG_FILE, WEIGHTS_FILE, AdapterFormatError, inspect_adapter_bytes
from adapters.optional_parts import OPTIONAL_PARTS, half_part
from adapters.sharing import ALL, OPERATOR_OWNER
from adapters.sources import fetch_adapter, parse_reference
from adapters.sources.policy import operator_policy
from server.api.adapter_intake import check_adapter_draft, check_adapter_heads, dora_scales_of_files
from server.api.state import ServerState
from server.credentials import ADMIN_TOKEN_FILE, DEMO_KEY_FILE, read_secret, write_secret
from tenants import Tenant

DEFAULT_TENANT = "default"
DEMO_TENANT = "demo"


@dataclass(frozen=True)
class StartupInfo:
    base_url: str
    model_id: str
    admin_token: str
    admin_token_file: Path | None   # where a generated admin token is kept (None: given by the operator)
    demo_tenant: str | None
    demo_key: str | None
    demo_key_file: Path | None
    demo_adapters: tuple[str, ...]
    # --adapter's preloads: (owner tenant, adapter name, whether the printed demo key can call it)
    preloaded: tuple[tuple[str, str, bool], ...] = ()

    def curl_line(self) -> str:
        body = (f'{{"model": "{self.model_id}", "messages": [{{"role": "user", "content": '
                f'"What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}')
        return (f"curl -s {self.base_url}/v1/chat/completions -H 'Authorization: Bearer {self.demo_key}' "
                f"-H 'Content-Type: application/json' -d '{body}'")


def _put_dir(state: ServerState, tenant: Tenant, name: str, directory: str | Path) -> None:
    """Store a PEFT directory (and its optional parts' folders: `medusa/` heads, a `draft/` LoRA) under the
    tenant unless the same adapter is already there."""
    d = Path(directory)
    _put_files(state, tenant.id, name, (d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes(),
               **_dir_parts(d))


def _dir_parts(d: Path) -> dict[str, tuple[bytes, bytes]]:
    """The operator's directory's optional parts (adapters.optional_parts), by AdapterFiles field."""
    parts = {}
    for part in OPTIONAL_PARTS:
        folder = d / part.folder
        if not folder.exists():
            continue
        for name in part.files:
            if not (folder / name).is_file():
                raise AdapterFormatError(f"{d}: {half_part(part, name)}")
        parts[part.name] = ((folder / part.files[0]).read_bytes(), (folder / part.files[1]).read_bytes())
    return parts


def _put_files(state: ServerState, owner: str, name: str, config_json: bytes, weights: bytes,
               medusa: tuple[bytes, bytes] | None = None, draft: tuple[bytes, bytes] | None = None) -> None:
    """`medusa`, `draft`: the adapter's own heads and draft LoRA files (a local directory's folders)."""
    extra_bytes = 0 if medusa is None else check_adapter_heads(state, medusa).nbytes
    extra_bytes += 0 if draft is None else check_adapter_draft(state, draft).size_bytes
    summary = inspect_adapter_bytes(config_json, weights, state.engine.info.adapter_shape,
                                    state.config.engine.lora.max_lora_rank)
    # What is stored is the canonical config (user patterns resolved once, here); its parts count in its size.
    config_json = summary.canonical_config_json
    summary = dataclasses.replace(summary, size_bytes=summary.size_bytes + extra_bytes)
    record = state.registry.get(owner, name)
    if (record is None or record.base != state.base
            or state.registry.read_files(record.version) != (config_json, weights)
            or state.registry.read_medusa(record.version) != medusa or state.registry.read_draft(record.version) != draft):
        record = state.registry.put(owner, name, config_json, weights, summary=summary, replace=True,
                                    base=state.base, medusa=medusa, draft=draft)
    dora_scales_of_files(state, record.version, config_json, weights)  # the first request reloads them


def publish_lora_modules(state: ServerState) -> None:
    """--lora-modules: fetch each (any source kind, any local path: the operator's own), store it under
    the operator, and share it with all tenants unless the admin already chose otherwise. Operator
    adapters no longer listed are retired."""
    wanted = dict(state.config.lora_modules)
    policy = operator_policy(state.sources)
    for name, path in wanted.items():
        files = fetch_adapter(parse_reference(path), policy, state.source_clients)
        _put_files(state, OPERATOR_OWNER, name, files.config_json, files.weights, files.medusa, files.draft)
        state.references.put(OPERATOR_OWNER, name, path, files.sha256)
        state.sharing.set_default(name, ALL)
    for name in set(state.sharing.all()) - set(wanted):
        record = state.registry.delete(OPERATOR_OWNER, name)
        if record is not None:
            state.engine.remove_adapter_nowait(record.version)
        state.references.delete(OPERATOR_OWNER, name)
        state.sharing.delete(name)


def _demo_key(state: ServerState, tenant: Tenant, path: Path) -> str:
    """The demo tenant's key: the one kept in the data dir while it still works, else a new one."""
    kept = read_secret(path)
    if kept is not None:
        owner = state.tenants.authenticate(kept)
        if owner is not None and owner.id == tenant.id:
            return kept
    _, key = state.tenants.create_key(tenant.name)
    write_secret(path, key)
    return key


def migrate_legacy_data(state: ServerState) -> None:
    """Re-key what an older loraplex stored under tenant names to the tenants' ids (idempotent):
    a deployment's Redis survives upgrades. Adapters of names with no tenant left are retired."""
    state.tenants.migrate_legacy_keys()
    for name in state.registry.legacy_index_names():
        tenant = state.tenants.get(name)
        if tenant is not None:
            state.registry.migrate_legacy_index(name, tenant.id)
        else:
            state.registry.purge_legacy_index(name)


def adapter_owner(tenant: str | None, demo_tenant: bool) -> str:
    """Who owns an --adapter with no TENANT/: the demo tenant while the demo is on (its key is printed,
    so the adapter is callable at once), else the `default` tenant."""
    if tenant is not None:
        return tenant
    return DEMO_TENANT if demo_tenant else DEFAULT_TENANT


def bootstrap(state: ServerState, base_url: str) -> StartupInfo:
    """Blocking (Redis and file reads): run it off the event loop."""
    cfg = state.config
    migrate_legacy_data(state)
    state.tenants.ensure(DEFAULT_TENANT)
    preloaded = []
    for tenant, name, directory in cfg.adapters:
        owner = adapter_owner(tenant, cfg.demo_tenant)
        _put_dir(state, state.tenants.ensure(owner), name, directory)
        preloaded.append((owner, name, cfg.demo_tenant and owner == DEMO_TENANT))
    publish_lora_modules(state)
    demo_key = demo_key_file = None
    demo_adapters: tuple[str, ...] = ()
    if cfg.demo_tenant:
        demo = state.tenants.ensure(DEMO_TENANT)
        demo_key_file = cfg.data_dir / DEMO_KEY_FILE
        demo_key = _demo_key(state, demo, demo_key_file)
        if state.demo is not None:
            for name, directory in state.demo.adapters.items():
                _put_dir(state, demo, name, directory)
            demo_adapters = tuple(state.demo.adapters)
    return StartupInfo(base_url=base_url, model_id=state.model_id, admin_token=cfg.admin_token,
                       admin_token_file=cfg.data_dir / ADMIN_TOKEN_FILE if cfg.admin_token_generated else None,
                       demo_tenant=DEMO_TENANT if cfg.demo_tenant else None, demo_key=demo_key,
                       demo_key_file=demo_key_file, demo_adapters=demo_adapters, preloaded=tuple(preloaded))
