"""Adapters by reference and by sharing: registering a source for a name, fetching it on first use
(or at once with prefetch), and resolving a request's adapter name among the caller's own adapters,
its references, and the operator's adapters shared with it (read-only, outside its quota)."""
from __future__ import annotations

import dataclasses
import hashlib

from starlette.concurrency import run_in_threadpool

from adapters.file_bound import bounded_by_model
from adapters.format import AdapterFormatError, inspect_adapter_bytes
from adapters.references import AdapterReference
from adapters.registry import AdapterRecord, validate_name
from adapters.sharing import OPERATOR_OWNER
from adapters.sources import SourceError, SourcePolicy, SourceRef, fetch_adapter, parse_reference
from adapters.sources.admission import admit_reference
from adapters.sources.policy import operator_policy
from server.api.adapter_intake import no_adapter_room, store_adapter
from server.api.base_identity import require_same_base, unavailable_reason
from server.api.errors import APIError
from server.api.fetch_flights import NEAR, REMOTE
from server.api.state import ServerState
from tenants import Quota, Tenant


def _policy(state: ServerState, owner: str) -> SourcePolicy:
    return operator_policy(state.sources) if owner == OPERATOR_OWNER else state.sources


async def fetch_and_store(state: ServerState, owner: str, quota: Quota | None,
                          ref: AdapterReference) -> AdapterRecord:
    """Fetch a reference's files (off the event loop, bounded by the source policy), validate and
    store them; the version stays the same when the content did. One fetch per (owner, name). A local
    directory goes through the near lane and the pager's process (bounded by the disk, like the
    page-ins it serves), never behind remote fetches."""
    source = parse_reference(ref.source)
    near = source.kind == "local"

    async def run() -> AdapterRecord:
        keys = None
        if source.kind == "s3" and owner != OPERATOR_OWNER:
            keys = await run_in_threadpool(state.source_credentials.get, owner, "s3")
        policy = _policy(state, owner)
        pool = state.pager if near and state.pager is not None else state.loaders
        if pool is not None:
            # Fetch and full validation in a loader process: the CPU a cold load costs stays off the
            # interpreter the engine thread runs on.
            loaded = await run_in_threadpool(pool.load, ref.source, policy, keys,
                                             state.engine.info.adapter_shape, state.config.engine.lora.max_lora_rank)
            config_json, weights, validated, sha256 = (loaded.summary.canonical_config_json, loaded.weights,
                                                       loaded.summary, loaded.sha256)
            parts = loaded
        else:
            bounded = bounded_by_model(policy, state.engine.info.adapter_shape, state.config.engine.lora.max_lora_rank)
            files = await run_in_threadpool(fetch_adapter, source, bounded, state.source_clients, keys)
            config_json, weights, validated, sha256 = files.config_json, files.weights, None, files.sha256
            parts = files
        record = await store_adapter(state, owner, quota, ref.name, config_json, weights, replace=True,
                                     keep_identical=True, validated=validated, medusa=parts.medusa, draft=parts.draft)
        current = await run_in_threadpool(state.references.get, owner, ref.name)
        if current is None or current.registered_at != ref.registered_at:
            # Unloaded (or registered anew) while this fetch ran: what it fetched is not wanted.
            await run_in_threadpool(state.registry.delete, owner, ref.name)
            await state.engine.remove_adapter(record.version)
            raise APIError(409, f"adapter '{ref.name}' was unloaded or replaced during its fetch", "adapter_changed")
        await run_in_threadpool(state.references.put, owner, ref.name, ref.source, sha256)
        return record

    return await state.fetches.run((owner, ref.name), run, NEAR if near else REMOTE)


def parsed_reference(source: str, policy: SourcePolicy, param: str) -> SourceRef:
    """`source` parsed and admitted by `policy` (adapters.sources.admission), or a 400/403 naming
    `param`, the request field that holds it. Blocking (a local path is resolved): off the event loop."""
    try:
        ref = parse_reference(source)
        admit_reference(ref, policy)
    except SourceError as e:
        raise APIError(e.status, e.message, e.code, param=param) from None
    return ref


async def register_reference(state: ServerState, owner: str, quota: Quota | None, name: str, source: str,
                             prefetch: bool, replace: bool,
                             param: str = "source") -> tuple[AdapterReference, AdapterRecord | None]:
    """Check the reference against the source policy now (so a refused one fails at once, lazy or
    not), keep it, and fetch it now when `prefetch`, else on first use. `param`: the request field
    that holds `source`."""
    await run_in_threadpool(parsed_reference, source, _policy(state, owner), param)
    previous = await run_in_threadpool(state.references.get, owner, name)
    exists = previous is not None or await run_in_threadpool(state.registry.get, owner, name) is not None
    if exists and not replace:
        raise APIError(409, f"adapter '{name}' already exists; send replace=true (load_inplace) to replace it",
                       "adapter_exists")
    if exists or quota is None or quota.max_adapters is None:
        stored = await run_in_threadpool(state.references.put, owner, name, source)
    else:
        stored = await run_in_threadpool(state.references.put_within, owner, name, source, quota.max_adapters)
        if stored is None:
            raise no_adapter_room(quota.max_adapters)
    if not prefetch:
        old = await run_in_threadpool(state.registry.delete, owner, name)
        if old is not None:  # the next use fetches the new reference
            await state.engine.remove_adapter(old.version)
        return stored, None
    try:
        record = await fetch_and_store(state, owner, quota, stored)
    except BaseException:
        # A failed registration leaves things as they were: nothing, or the reference it replaced.
        if previous is None:
            await run_in_threadpool(state.references.delete, owner, name)
        else:
            await run_in_threadpool(state.references.restore, owner, previous)
        raise
    return await run_in_threadpool(state.references.get, owner, name) or stored, record


async def unregister(state: ServerState, owner: str, name: str) -> AdapterRecord | None | bool:
    """Forget a name's reference and stored version; False when it had neither."""
    had_ref = await run_in_threadpool(state.references.delete, owner, name)
    record = await run_in_threadpool(state.registry.delete, owner, name)
    if record is not None:
        await state.engine.remove_adapter(record.version)
    return record if record is not None else had_ref


def _not_found(model: str) -> APIError:
    return APIError(404, f"the model '{model}' does not exist", "model_not_found")


async def resolve_adapter(state: ServerState, tenant: Tenant, name: str) -> AdapterRecord:
    """The caller's own adapter, else its reference (fetched now if never fetched), else an operator
    adapter shared with it; 404 otherwise, the same whether or not another tenant has one."""
    try:
        validate_name(name)
    except ValueError:
        raise _not_found(name) from None
    found = await _usable(state, tenant.id, tenant.quota, name)
    if found is None and await run_in_threadpool(state.sharing.visible, name, tenant.id):
        found = await _usable(state, OPERATOR_OWNER, None, name)
    if found is None:
        raise _not_found(name)
    return found


async def _usable(state: ServerState, owner: str, quota: Quota | None, name: str) -> AdapterRecord | None:
    """`owner`'s stored version of `name` if it was validated against the served base; else its
    reference's, fetched (again) and validated now; a 400 naming both bases for an upload of another
    base (server.api.base_identity); None if `owner` has no such name."""
    record = await run_in_threadpool(state.registry.get, owner, name)
    if record is not None and not record.base:
        record = await _claim_unrecorded_base(state, record)
    if record is not None and unavailable_reason(record, state.base) is None:
        return record
    ref = await run_in_threadpool(state.references.get, owner, name)
    if ref is not None:
        return await fetch_and_store(state, owner, quota, ref)
    return None if record is None else require_same_base(record, state.base)


async def _claim_unrecorded_base(state: ServerState, record: AdapterRecord) -> AdapterRecord:
    """A version stored before bases were recorded: validated against the served base once, on its first
    use, and that base recorded on it; one that does not fit is a 400 naming it, not a failed load."""
    def check() -> None:
        config_json, weights = state.registry.read_files(record.version)
        inspect_adapter_bytes(config_json, weights, state.engine.info.adapter_shape,
                              state.config.engine.lora.max_lora_rank)

    try:
        await run_in_threadpool(check)
    except AdapterFormatError as e:
        raise APIError(400, f"adapter '{record.name}' was stored before loraplex recorded adapters' base models "
                            f"and does not fit the served base model '{state.model_id}' ({e}): upload it again "
                            "for this model", "adapter_base_mismatch", param="model") from None
    await run_in_threadpool(state.registry.claim_base, record.version, state.base)
    return dataclasses.replace(record, base=state.base)


_LORAX_SOURCES = {"s3": "s3://", "local": "", "https": "https://", "http": "http://", "url": ""}


async def resolve_lorax_adapter(state: ServerState, tenant: Tenant, adapter_id: str,
                                adapter_source: str | None) -> AdapterRecord:
    """LoRAX's per-request `adapter_id` (+ `adapter_source`): without a source (or `name`), the name
    of an adapter the caller may use; with one, a reference the caller may fetch, registered under a
    name derived from it (`ref-` + its hash) the first time and reused after."""
    if adapter_source in (None, "name"):
        return await resolve_adapter(state, tenant, adapter_id)
    if adapter_source not in _LORAX_SOURCES:
        raise APIError(400, f"'adapter_source' {adapter_source!r} is not supported: use "
                            f"{', '.join(sorted(_LORAX_SOURCES))} (no model hub is reachable from loraplex)",
                       "invalid_value", param="adapter_source")
    scheme = _LORAX_SOURCES[adapter_source]
    source = adapter_id if not scheme or adapter_id.startswith(scheme) else scheme + adapter_id
    kind = (await run_in_threadpool(parsed_reference, source, _policy(state, tenant.id), "adapter_id")).kind
    if adapter_source not in ("url", kind) and not (adapter_source == "local" and kind == "local"):
        raise APIError(400, f"'adapter_id' is not a {adapter_source} reference", "invalid_value",
                       param="adapter_id")
    name = "ref-" + hashlib.sha256(source.encode()).hexdigest()[:24]
    record = await run_in_threadpool(state.registry.get, tenant.id, name)
    if record is not None and unavailable_reason(record, state.base) is None:
        return record
    ref = await run_in_threadpool(state.references.get, tenant.id, name)
    if ref is not None:
        return await fetch_and_store(state, tenant.id, tenant.quota, ref)
    ref, _ = await register_reference(state, tenant.id, tenant.quota, name, source, prefetch=False,
                                      replace=False, param="adapter_id")
    try:
        return await fetch_and_store(state, tenant.id, tenant.quota, ref)
    except BaseException:
        # A reference this request made and could not fetch is not kept: it would hold a place
        # under max_adapters for something that never loaded.
        current = await run_in_threadpool(state.references.get, tenant.id, name)
        if current is not None and current.registered_at == ref.registered_at:
            await run_in_threadpool(state.references.delete, tenant.id, name)
        raise
