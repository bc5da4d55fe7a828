"""Request and response bodies of the admin, adapter, usage and ops endpoints (pydantic models).

Quota values are validated here for the schema and again by tenants.Quota,
which owns their meaning (a PATCH merges into the stored quota there).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, RootModel, StringConstraints


def _json_number(value: Any) -> Any:
    """A quota is a JSON number: pydantic's lax mode would take "5" or true (the published schema says
    integer or number, and a client sending a string has a bug worth hearing about)."""
    if isinstance(value, (bool, str)):
        raise ValueError("must be a number")
    return value


Limit = Annotated[int, Field(ge=0, le=(1 << 63) - 1), BeforeValidator(_json_number)] | None
TenantName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]


class QuotaFields(BaseModel):
    """Per-tenant limits; null (or absent at creation) means unlimited; `weight` is the fair share."""

    model_config = ConfigDict(extra="forbid")
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    max_concurrent_requests: Limit = None
    max_adapters: Limit = None
    max_adapter_bytes: Limit = None
    max_lora_rank: Limit = None
    max_tokens_per_request: Limit = None
    weight: Annotated[float, Field(gt=0.0, le=1e6, allow_inf_nan=False), BeforeValidator(_json_number)] = 1.0


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: TenantName
    quota: QuotaFields | None = None


class TenantPatch(BaseModel):
    """Only the quota fields given change (null: unlimited). The fields may also be sent unwrapped."""

    model_config = ConfigDict(extra="forbid")
    quota: QuotaFields


class TenantPatchBody(RootModel[TenantPatch | QuotaFields]):
    """PATCH /admin/tenants/{name} as published: {"quota": {...}}, or the quota fields unwrapped. An empty
    body is refused (400 naming `quota`): it changes nothing and is most likely a mistake."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1})


class Quota(QuotaFields):
    model_config = ConfigDict(extra="ignore")


class TenantOut(BaseModel):
    id: str
    name: str
    quota: Quota
    created_at: float


class KeyInfo(BaseModel):
    id: str
    created_at: float
    last_used_at: float | None = Field(None, description="to the minute; null if never used")


class KeyList(BaseModel):
    object: Literal["list"]
    data: list[KeyInfo]


class TenantDetail(TenantOut):
    keys: list[KeyInfo]
    adapters: int


class TenantList(BaseModel):
    object: Literal["list"]
    data: list[TenantOut]


class TenantDeleted(BaseModel):
    name: str
    id: str
    deleted: Literal[True]
    adapters_retired: int


class KeyCreated(BaseModel):
    id: str
    key: str = Field(description="shown once; stored only as a salted hash")
    tenant: str


class KeyDeleted(BaseModel):
    id: str
    deleted: Literal[True]


class AdapterOut(BaseModel):
    object: Literal["adapter"]
    id: str
    name: str
    version: str
    rank: int
    target_modules: list[str]
    size_bytes: int
    created_at: float


class AdapterList(BaseModel):
    object: Literal["list"]
    data: list[AdapterOut]


class AdapterPin(BaseModel):
    """An adapter version pinned on the device (or unpinned; was_pinned: whether it had been)."""

    adapter: str
    version: str
    pinned: bool
    was_pinned: bool | None = None


class AdapterDeleted(BaseModel):
    id: str
    name: str
    object: Literal["adapter"]
    deleted: Literal[True]


class AdapterUpload(BaseModel):
    """multipart/form-data: a `name` field and the two PEFT files."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    replace: Literal["true", "false", "1", "0"] = "false"
    adapter_config_json: bytes = Field(alias="adapter_config.json", json_schema_extra={"format": "binary"})
    adapter_model_safetensors: bytes = Field(alias="adapter_model.safetensors",
                                             json_schema_extra={"format": "binary"})


class UsageCounters(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int


class UsageTotal(UsageCounters):
    adapters: dict[str, UsageCounters] = Field(description="per adapter name; \"\" is the base model")


class UsageDay(UsageTotal):
    date: str


class UsageOut(BaseModel):
    object: Literal["usage"]
    tenant: str
    limits: Quota
    current: dict[str, Any]
    days: list[UsageDay]
    total: UsageTotal


class RefusalCounts(BaseModel):
    refused: int
    reasons: dict[str, int] = Field(description="refusals by reason (tenants.REFUSAL_REASONS); "
                                                "a reason with none is absent")


class RefusalDay(RefusalCounts):
    date: str


class RefusalsOut(BaseModel):
    object: Literal["refusals"]
    tenant: str
    days: list[RefusalDay]
    total: RefusalCounts


class VersionInfo(BaseModel):
    """GET /version: what this replica runs."""
    model_config = ConfigDict(extra="allow")
    version: str | None
    torch: str
    triton: str | None
    transformers: str | None
    device: str
    dtype: str
    model: str
    replica: str | None


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: Literal["ok", "unavailable"]
    engine: bool
    redis: bool
    model: str
    engine_error: str | None = None
    engine_restarting: bool | None = None


class AdminAdapter(AdapterOut):
    tenant: str
    tenant_id: str
    residency: Literal["redis", "host", "device"] = Field(
        description="the fastest tier holding it on this replica: device slot, host memory, or only Redis")


class AdminAdapterList(BaseModel):
    object: Literal["list"]
    data: list[AdminAdapter]
    total: int
    offset: int
    limit: int


class EnginePoint(BaseModel):
    t: float
    tokens_per_s: float
    ttft_p50_s: float | None
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


class EngineCoreView(BaseModel):
    """One engine core of --data-parallel-size (server.api.admin_views.engine_core_view)."""
    engine: int
    healthy: bool
    error: str | None
    restarts: int
    routed: int  # requests routed to it since start
    running: int
    waiting: int
    kv_blocks: dict[str, int]
    slots: dict[str, int | float | None]
    host: dict[str, int]


class EngineView(BaseModel):
    healthy: bool
    error: str | None
    running: int
    waiting: int
    preemptions: int
    kv_blocks: dict[str, int]
    # --unified-memory: the pool's units, their bytes, shares and split (kv, adapter, cached free, free); else None
    memory_pool: dict[str, int] | None = None
    # the pool's stored dtype (auto resolved; fp8_e4m3/fp8_e5m2), the flag's value, blocks, tokens, bytes
    kv_cache: dict[str, str | int]
    # device slots (or pages) and the host tier: counts, bytes, hits and misses, and their hit rate (None
    # before the first lookup)
    slots: dict[str, int | float | None]
    host: dict[str, int | float | None]
    store: dict[str, int | float] | None  # Redis's adapters and bytes, counted at most once a minute; None: not yet
    prefix_cache: dict[str, bool | int | float | None]
    cuda_graphs: dict[str, bool | int | float]  # decode graphs captured, replays, capture seconds and bytes
    structured_output: dict[str, int | float]
    dora_scales: dict[str, int]  # DoRA adapters' scales computed, read from Redis, refused, stored, store errors
    # method (None: off), verify steps, drafts verified and accepted (also per draft position), acceptance
    # rate, mean accepted length and steps skipped by disable_by_batch_size (server.api.admin_views)
    speculative_decoding: dict[str, str | int | float | list[int] | None]
    engines: list[EngineCoreView] = []  # --data-parallel-size: each core's own (the fields above sum them)
    history: list[EnginePoint]
