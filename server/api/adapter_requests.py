"""Bodies of the by-reference adapter endpoints: loraplex's JSON `POST /v1/adapters`, vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, and the admin's sharing of operator adapters."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema

from adapters.sources.reference import MAX_REFERENCE_CHARS

AdapterName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
# Printable ASCII, as adapters.sources.reference checks: a URL's other characters are percent-encoded.
Source = Annotated[str, StringConstraints(min_length=1, max_length=MAX_REFERENCE_CHARS, pattern=r"^[ -~]+$")]


class AdapterByReference(BaseModel):
    """Register an adapter by where it lives; fetched on first use unless `prefetch`."""

    model_config = ConfigDict(extra="forbid")
    name: AdapterName
    source: Source = Field(description="s3://BUCKET/PREFIX, https://HOST/DIR/ (its two files), "
                                       "https://HOST/ADAPTER.tar.gz|.tgz|.tar|.zip, or a directory under the "
                                       "server's --adapter-local-root")
    prefetch: bool = Field(False, description="fetch and validate now rather than at first use")
    replace: bool = False


class LoadLoraAdapter(BaseModel):
    """vLLM's body; `load_inplace` replaces an adapter of that name (vLLM's meaning). loraplex adds
    `prefetch` (default true here, as vLLM loads at once: false defers the fetch to first use)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName
    lora_path: Source
    load_inplace: bool = False
    prefetch: bool = True


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName
    # Published as null only: any other value is refused (400 naming it) by the route.
    lora_int_id: Annotated[int | None, WithJsonSchema({"type": "null"})] = Field(
        None, description="vLLM's; loraplex names adapters only, so it must be absent or null")


class SharedAdapterSharing(BaseModel):
    """Who may use an operator adapter: "all" tenants, or a list of tenant names (empty: none)."""

    model_config = ConfigDict(extra="forbid")
    tenants: Literal["all"] | Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=64)]],
                                        Field(max_length=10000)]
