"""Reading an adapter upload: a multipart body whose size cap is enforced while it
streams in (Content-Length first, then a running byte count), never after
buffering it all."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from adapters import draft_lora, medusa_format
from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, PICKLE_FILE, WEIGHTS_FILE
from server.api.errors import APIError

# Multipart boundaries, part headers and the small fields around the two files.
FORM_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class AdapterUpload:
    name: str
    replace: bool
    config_json: bytes
    weights: bytes
    # Its own Medusa heads (the optional files medusa_config.json and medusa_heads.safetensors), unchecked.
    medusa: tuple[bytes, bytes] | None = None
    # Its draft LoRA (the optional files draft_adapter_config.json and draft_adapter_model.safetensors), unchecked.
    draft: tuple[bytes, bytes] | None = None


def _too_large(cap: int) -> APIError:
    return APIError(413, f"upload larger than the limit of {cap} bytes", "request_too_large")


async def _capped(request: Request, cap: int) -> AsyncIterator[bytes]:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > cap:
            raise _too_large(cap)
        yield chunk


async def read_adapter_upload(request: Request, cap: int) -> AdapterUpload:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, f"upload an adapter as multipart/form-data with a 'name' field and "
                            f"the files {CONFIG_FILE} and {WEIGHTS_FILE}", "invalid_upload")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length", "invalid_upload")
        if int(length) > cap:
            raise _too_large(cap)
    parser = MultiPartParser(request.headers, _capped(request, cap), max_files=6, max_fields=8,
                             max_part_size=64 * 1024)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        raise APIError(400, f"malformed multipart body: {e.message}", "invalid_upload") from None
    try:
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "the form needs a 'name' field", "invalid_field", param="name")
        replace = form.get("replace", "false")
        if not isinstance(replace, str) or replace.lower() not in ("true", "false", "1", "0"):
            raise APIError(400, "'replace' must be true or false", "invalid_field", param="replace")
        files = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key == PICKLE_FILE or (value.filename or "").endswith((".bin", ".pt", ".pkl")):
                    raise APIError(400, f"pickle files ({PICKLE_FILE}) are never loaded; save the "
                                        f"adapter with safe_serialization=True", "invalid_adapter")
                files[key] = value
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if f not in files]
        if missing:
            raise APIError(400, f"the form is missing the file(s) {', '.join(missing)}",
                           "invalid_field", param=missing[0])
        config_json = await files[CONFIG_FILE].read()
        if len(config_json) > MAX_CONFIG_BYTES:
            raise APIError(413, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes",
                           "request_too_large")
        weights = await files[WEIGHTS_FILE].read()
        medusa = await _optional_pair(files, (medusa_format.CONFIG_FILE, medusa_format.WEIGHTS_FILE), "medusa heads")
        draft = await _optional_pair(files, draft_lora.FORM_FILES, "draft LoRA")
        if draft is not None and len(draft[0]) > MAX_CONFIG_BYTES:
            raise APIError(413, f"{draft_lora.FORM_FILES[0]} is larger than {MAX_CONFIG_BYTES} bytes",
                           "request_too_large")
        return AdapterUpload(name, replace.lower() in ("true", "1"), config_json, weights, medusa, draft)
    finally:
        await form.close()


async def _optional_pair(files: dict[str, UploadFile], names: tuple[str, str], what: str) -> tuple[bytes, bytes] | None:
    """An optional part's two form files (config, weights): both or neither, else a 400 naming the missing one."""
    present = [f for f in names if f in files]
    if len(present) == 1:
        other = (set(names) - set(present)).pop()
        raise APIError(400, f"{what}: the form has {present[0]} without {other} (both files or neither)",
                       "invalid_field", param=other)
    if not present:
        return None
    return await files[names[0]].read(), await files[names[1]].read()
