"""The loader process's side: fetch an adapter from its source, validate it exactly as an upload
is validated (config, safetensors header, every tensor's values) and send back the bytes to store.

This is the CPU-heavy part of a cold load (S3 signing and XML, TLS, archive extraction, safetensors
parsing, finite and range checks): in the server process it takes the interpreter from the engine
thread and other tenants' tokens slow down (adapters.loader_pool runs it here instead).

Wire (both ways, multiprocessing Connection.send_bytes/recv_bytes, never pickle): a message is one
JSON header, then as many raw byte blobs as the header's "blobs" says. Nothing a tenant controls is
ever unpickled by either side.
"""
from __future__ import annotations

import json
import os

import torch
from dataclasses import asdict, fields
from multiprocessing.connection import Connection
from pathlib import Path

from adapters.file_bound import bounded_by_model
from adapters.format import AdapterFormatError, ModelShape, inspect_adapter_bytes, load_adapter_bytes
from adapters.optional_parts import OPTIONAL_PARTS
from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from adapters.sources.clients import SourceClients
from adapters.vocab_format import to_wire

MAX_HEADER_BYTES = 64 << 10   # a header is a few hundred bytes; a bigger one is a broken peer


def send(conn: Connection, header: dict, blobs: tuple[bytes, ...] = ()) -> None:
    conn.send_bytes(json.dumps({**header, "blobs": len(blobs)}).encode())
    for blob in blobs:
        conn.send_bytes(blob)


def receive(conn: Connection, max_blob_bytes: int) -> tuple[dict, list[bytes]]:
    """OSError when a part is over its bound (Connection.recv_bytes's maxlength), EOFError when the
    peer is gone, ValueError when the header is not what `send` writes."""
    header = json.loads(conn.recv_bytes(MAX_HEADER_BYTES))
    count = header.get("blobs") if isinstance(header, dict) else None
    if not isinstance(count, int) or not 0 <= count <= 4:
        raise ValueError("malformed message header")
    return header, [conn.recv_bytes(max_blob_bytes) for _ in range(count)]


def policy_to_json(policy: SourcePolicy) -> dict:
    out = asdict(policy)
    for name in ("kinds", "s3_buckets", "http_hosts"):
        out[name] = sorted(out[name])
    out["local_root"] = None if policy.local_root is None else str(policy.local_root)
    return out


def policy_from_json(data: dict) -> SourcePolicy:
    known = {f.name for f in fields(SourcePolicy)}
    data = {k: v for k, v in data.items() if k in known}
    for name in ("kinds", "s3_buckets", "http_hosts"):
        data[name] = frozenset(data[name])
    data["local_root"] = None if data["local_root"] is None else Path(data["local_root"])
    return SourcePolicy(**data)


class _Keys:
    """A tenant's S3 credentials as adapters.sources.s3_fetch.S3Keys wants them."""

    def __init__(self, access_key_id: str, secret_access_key: str, session_token: str | None) -> None:
        self.access_key_id = access_key_id
        self.secret_access_key = secret_access_key
        self.session_token = session_token


def _fetch_job(job: dict, clients: SourceClients) -> tuple[dict, tuple[bytes, ...]]:
    keys = None if job.get("s3_keys") is None else _Keys(**job["s3_keys"])
    shape = ModelShape(**job["shape"])
    rank_cap = job["max_lora_rank"]
    policy = bounded_by_model(policy_from_json(job["policy"]), shape, rank_cap)
    files = fetch_adapter(parse_reference(job["reference"]), policy, clients, keys)
    summary = inspect_adapter_bytes(files.config_json, files.weights, shape, rank_cap)
    load_adapter_bytes(summary.canonical_config_json, files.weights, shape, rank_cap)  # values too
    # Its optional parts (heads, a draft LoRA) as fetched, unchecked here: named in the header, their files after.
    parts = [p.name for p in OPTIONAL_PARTS if getattr(files, p.name) is not None]
    header = {"ok": True, "rank": summary.rank, "target_modules": list(summary.target_modules),
              "size_bytes": summary.size_bytes, "sha256": files.sha256, "parts": parts}
    return header, (summary.canonical_config_json, files.weights, *(b for p in parts for b in getattr(files, p)))


def _parse_job(job: dict, blobs: list[bytes]) -> tuple[dict, tuple[bytes, ...]]:
    """A stored version's files (from the registry) parsed and value-checked as the engine loads them;
    back come its tensors as float32, one module after another (A, then B, then a DoRA magnitude)."""
    config_json, weights = blobs
    adapter = load_adapter_bytes(config_json, weights, ModelShape(**job["shape"]), job["max_lora_rank"])
    modules, parts = [], []
    for (layer, proj), w in adapter.weights.items():
        modules.append([layer, proj, w.rank, w.a.shape[1], w.b.shape[0], w.scaling, w.magnitude is not None])
        parts += [w.a, w.b] + ([w.magnitude] if w.magnitude is not None else [])
    vocab, vocab_tensors = to_wire(adapter.vocab)  # embed_tokens and lm_head parts, after the modules
    parts += vocab_tensors
    flat = torch.cat([t.reshape(-1) for t in parts]) if parts else torch.zeros(0)  # flat: [sum numel] float32
    header = {"ok": True, "rank": adapter.rank, "target_modules": list(adapter.target_modules),
              "use_rslora": bool(adapter.use_rslora), "size_bytes": adapter.size_bytes, "modules": modules,
              "vocab": vocab}
    return header, (json.dumps(dict(adapter.config)).encode(), flat.numpy().tobytes())


def serve(conn: Connection, max_job_bytes: int, torch_threads: int = 1) -> None:
    """The loader process's loop (a multiprocessing target): one job at a time until the pipe closes.
    `max_job_bytes` bounds each part of a job it reads (a stored adapter's files to parse)."""
    # One load at a time per process: more threads would only fight the engine for the cores.
    torch.set_num_threads(torch_threads)
    clients = SourceClients()  # boto3 clients and the TLS context, made once for this process's life
    send(conn, {"ok": True, "ready": os.getpid()})
    while True:
        try:
            job, blobs = receive(conn, max_job_bytes)
        except (EOFError, OSError, ValueError):
            return
        try:
            header, blobs = _fetch_job(job, clients) if job["job"] == "fetch" else _parse_job(job, blobs)
        except SourceError as e:
            header, blobs = {"ok": False, "kind": "source", "status": e.status, "code": e.code,
                             "message": e.message}, ()
        except AdapterFormatError as e:
            header, blobs = {"ok": False, "kind": "format", "message": str(e), "param": e.param}, ()
        except Exception as e:  # noqa: BLE001 - a bug or a library's surprise fails this load, not the process
            # The type only: a library's message may quote a request (signed headers, a URL's query).
            header, blobs = {"ok": False, "kind": "source", "status": 502, "code": "adapter_load_failed",
                             "message": f"loading {str(job.get('reference', 'a stored adapter'))[:200]!r} failed "
                                        f"in the adapter loader process ({type(e).__name__})"}, ()
        try:
            send(conn, header, blobs)
        except (BrokenPipeError, OSError):
            return
