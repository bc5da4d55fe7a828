"""One path from two PEFT files to a registry version, whatever brought them (an upload, a source
fetch, the operator's --lora-modules): the tenant's quota, the server's caps, the engine loader's
full rules (values included), the canonical config, then the registry; and a DoRA version's scales
against the served base, computed and stored before the answer (server.engine.lora.dora_precompute), so the
first request for it loads them from Redis instead of computing them."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import Future

from starlette.concurrency import run_in_threadpool

from adapters import draft_lora
from adapters.draft_lora import draft_from_bytes
from adapters.format import AdapterFormatError, AdapterSummary, LoraAdapter, inspect_adapter_bytes, load_adapter_bytes
from adapters.medusa_format import MAX_ADAPTER_HEADS, HeadWeights, MedusaHeadsError, check_heads
from adapters.registry import AdapterRecord
from server.api.errors import APIError
from server.api.state import ServerState
from tenants import Quota


async def store_adapter(state: ServerState, owner: str, quota: Quota | None, name: str, config_json: bytes,
                        weights: bytes, replace: bool, keep_identical: bool = False,
                        validated: AdapterSummary | None = None,
                        medusa: tuple[bytes, bytes] | None = None,
                        draft: tuple[bytes, bytes] | None = None) -> AdapterRecord:
    """Validate and store; `quota` None: the operator's own adapter (no tenant's limits apply).
    `keep_identical`: if the name already holds exactly these bytes, keep that version (its id is
    what the KV cache and the tiers are keyed on) rather than make a new one. `validated`: a loader
    process already ran the full validation below on these bytes, against this server's model
    shape and rank cap (adapters.loader_pool), and `config_json` is its canonical config. `medusa`: the
    adapter's own Medusa heads files (config, weights), checked against the base and stored with it; `draft`:
    its draft LoRA's files, checked against the draft model and stored with it."""
    heads_bytes = 0 if medusa is None else check_adapter_heads(state, medusa).nbytes
    draft_bytes = 0 if draft is None else (await run_in_threadpool(check_adapter_draft, state, draft)).size_bytes
    if name == state.model_id:
        raise APIError(400, f"an adapter cannot be named like the base model {state.model_id!r}", "invalid_field",
                       param="name")
    shape = state.engine.info.adapter_shape
    rank_cap = state.config.engine.lora.max_lora_rank
    summary = validated or await run_in_threadpool(inspect_adapter_bytes, config_json, weights, shape, rank_cap)
    # Its own heads and draft LoRA count as its bytes (float32, like the summary): the quota, the host tier's
    # budget and the record's size_bytes.
    size = summary.size_bytes + heads_bytes + draft_bytes
    if quota is not None and quota.max_lora_rank is not None and summary.rank > quota.max_lora_rank:
        raise APIError(400, f"adapter rank {summary.rank} exceeds this tenant's max_lora_rank of "
                            f"{quota.max_lora_rank}", "max_lora_rank")
    if quota is not None and quota.max_adapter_bytes is not None and size > quota.max_adapter_bytes:
        parts = [f"{n} of them its {what}" for n, what in ((heads_bytes, "medusa heads"), (draft_bytes, "draft LoRA"))
                 if n]
        with_heads = f" ({', '.join(parts)})" if parts else ""
        raise APIError(413, f"adapter size {size} bytes (as float32){with_heads} exceeds this "
                            f"tenant's max_adapter_bytes of {quota.max_adapter_bytes}", "max_adapter_bytes")
    host_budget = state.engine.info.max_cpu_lora_bytes
    # The host tier keeps adapters (and draft LoRAs) in the serving dtype, heads in float32; the summary counts
    # float32.
    host_bytes = (summary.size_bytes + draft_bytes) * state.engine.info.dtype_bytes // 4 + heads_bytes
    if host_budget is not None and host_bytes > host_budget:
        # It could never be paged in: every request for it would fail.
        raise APIError(413, f"adapter size {host_bytes} bytes (in the serving dtype) exceeds the server's "
                            f"host adapter budget of {host_budget} bytes (--max-cpu-lora-bytes)",
                       "adapter_too_large")
    # The engine loader's full rules (tensor values included), the same code that serves it.
    if validated is None or json.loads(summary.canonical_config_json).get("use_dora", False):
        # A loader process validated a fetched adapter already; a DoRA one is parsed again for its scales.
        adapter = await run_in_threadpool(load_adapter_bytes, summary.canonical_config_json, weights, shape,
                                          rank_cap)
        # Kept for its scales only if DoRA: a plain LoRA adapter's float32 tensors are freed before the store.
        dora = adapter if adapter.use_dora else None
        del adapter
    else:
        dora = None
    await check_adapter_room(state, owner, quota, name)
    old = await run_in_threadpool(state.registry.get, owner, name)
    if keep_identical and old is not None:
        stored = await run_in_threadpool(state.registry.read_files, old.version)
        if (stored == (summary.canonical_config_json, weights) and old.base == state.base
                and state.registry.read_medusa(old.version) == medusa and state.registry.read_draft(old.version) == draft):
            await _precompute(state, old.version, dora)  # stored against another base, maybe
            return old
    # The canonical config is stored: the user's patterns were resolved once, above, and a
    # later load never runs them again.
    record = await run_in_threadpool(
        lambda: state.registry.put(owner, name, summary.canonical_config_json, weights,
                                   summary=dataclasses.replace(summary, size_bytes=size),
                                   replace=replace, max_adapters=None if quota is None else quota.max_adapters,
                                   base=state.base, medusa=medusa, draft=draft))
    if old is not None and old.version != record.version:
        await state.engine.remove_adapter(old.version)  # other processes hear it via the registry's events
    # Waited for (a W A^T per DoRA module, on the engine's one precompute thread, off the event loop):
    # an answered upload's first request then reloads, at a LoRA load's cost.
    await _precompute(state, record.version, dora)
    return record


def check_adapter_heads(state: ServerState, medusa: tuple[bytes, bytes]) -> HeadWeights:
    """400 naming the mismatch for heads that do not fit the base (hidden size, vocabulary, tensors), are over
    the bound (MAX_ADAPTER_HEADS, their bytes), or are fewer than a medusa server's num_speculative_tokens."""
    shape = state.engine.info.adapter_shape
    try:
        return check_heads(*medusa, shape.hidden_size, shape.vocab_size or 0, min_heads=state.engine.info.medusa_heads_needed,
                    max_heads=MAX_ADAPTER_HEADS)
    except MedusaHeadsError as e:
        raise APIError(400, str(e), "invalid_adapter", param="medusa_heads.safetensors") from None


def check_adapter_draft(state: ServerState, draft: tuple[bytes, bytes]) -> LoraAdapter:
    """400 naming the mismatch for a draft LoRA that does not fit the draft model (or the rank cap, or is DoRA),
    or that a server without a draft model is given. Blocking: it parses the tensors."""
    try:
        return draft_from_bytes(*draft, state.engine.info.draft_adapter_shape,
                                state.config.engine.lora.max_lora_rank)
    except AdapterFormatError as e:
        raise APIError(400, str(e), "invalid_adapter", param=draft_lora.FORM_FILES[1]) from None


async def check_adapter_room(state: ServerState, owner: str, quota: Quota | None, name: str) -> None:
    """403 when `name` is new to `owner` and would take it past max_adapters: stored adapters and
    references (lazy ones included) count together, by name. An early refusal before the work of
    validating; the registry's commit (and ReferenceStore.put_within) count the same atomically."""
    if quota is None or quota.max_adapters is None:
        return
    if await run_in_threadpool(_holds_room_for, state, owner, name, quota.max_adapters):
        return
    raise no_adapter_room(quota.max_adapters)


def no_adapter_room(max_adapters: int) -> APIError:
    return APIError(403, f"tenant already has the maximum of {max_adapters} adapters; delete one "
                         "or ask the operator for a higher max_adapters", "max_adapters")


def _holds_room_for(state: ServerState, owner: str, name: str, limit: int) -> bool:
    names = {r.name for r in state.registry.list(owner)} | set(state.references.list(owner))
    return name in names or len(names) < limit


async def _precompute(state: ServerState, version: str, dora: LoraAdapter | None) -> None:
    if dora is not None:
        # Shielded: a client that leaves does not cancel the computation, which the next load would redo.
        await asyncio.shield(asyncio.wrap_future(dora_scales(state, version, dora)))


def dora_scales(state: ServerState, version: str, adapter: LoraAdapter) -> Future[str]:
    """Compute and store a DoRA `version`'s scales against the served base unless the store has them
    (its outcome: server.engine.lora.dora_precompute); a plain LoRA adapter is done at once."""
    return state.engine.precompute_dora(version, adapter)


def dora_scales_of_files(state: ServerState, version: str, config_json: bytes, weights: bytes) -> str:
    """Blocking dora_scales for stored files (start-up preloads): only a DoRA config's files are parsed."""
    if not json.loads(config_json).get("use_dora", False):
        return "lora"
    adapter = load_adapter_bytes(config_json, weights, state.engine.info.adapter_shape,
                                 state.config.engine.lora.max_lora_rank)
    return dora_scales(state, version, adapter).result()
