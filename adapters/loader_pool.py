"""LoaderPool: a few long-lived loader processes that fetch and validate adapters from their sources
(adapters.loader_worker), so a storm of cold loads spends its CPU outside the server process and the
engine thread keeps the interpreter.

Started once (spawn: a fresh interpreter, no copy of the server's threads or locks); each process
runs one load at a time. A load has a time budget (the source's fetch timeout plus
`validation_seconds`) and a byte budget (what comes back is capped). A process that dies mid-load
(a crash, the OOM killer, kill -9), overruns its budget or answers nonsense is killed and replaced:
that load fails with a LoaderError that says why, and the next load gets a fresh process.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import TypeVar

import torch

from adapters.format import (
    MAX_CONFIG_BYTES, AdapterFormatError, AdapterSummary, LoraAdapter, LoraWeights, ModelShape)
from adapters.optional_parts import OPTIONAL_PARTS
from adapters.loader_worker import receive, send, policy_to_json, serve
from adapters.sources import SourceError, SourcePolicy
from adapters.sources.s3_fetch import S3Keys
from adapters.vocab_format import from_wire

# A worker imports torch, safetensors and boto3 before it is ready; a loaded 2-core machine takes seconds.
_START_SECONDS = 120.0
T = TypeVar("T")


class LoaderError(SourceError):
    """The loader process failed this load (died, overran its budget, answered nonsense): 502 or 504."""


@dataclass(frozen=True)
class LoadedAdapter:
    summary: AdapterSummary      # from the loader's full validation; canonical_config_json is what to store
    weights: bytes               # adapter_model.safetensors as fetched
    sha256: str                  # content hash of the fetched files (adapters.sources.AdapterFiles.sha256)
    medusa: tuple[bytes, bytes] | None = None  # its own Medusa heads files as fetched (AdapterFiles.medusa)
    draft: tuple[bytes, bytes] | None = None  # its draft LoRA's files as fetched (AdapterFiles.draft)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False


class LoaderPool:
    """`max_bytes`: the most one file of a load may hold (the server's upload cap); what crosses the
    pipe either way is bounded by it (twice it, as float32 of a 16-bit file, plus a config's room)."""

    def __init__(self, workers: int, max_bytes: int, validation_seconds: float = 60.0,
                 cpus: tuple[int, ...] | None = None) -> None:
        """`cpus`: the cores each loader process runs on (server.cpu_placement); None: its starter's."""
        assert workers >= 1
        assert validation_seconds > 0
        self._max_bytes = 2 * max_bytes + 4 * MAX_CONFIG_BYTES
        self._ctx = multiprocessing.get_context("spawn")
        self._validation_seconds = validation_seconds
        self._cpus = cpus
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: dict[int, _Worker] = {}  # pid -> every live loader process
        self._busy: set[int] = set()  # pids running a load
        self._closed = False
        self.restarts = 0
        for _ in range(workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=serve, args=(child, self._max_bytes), name="loraplex-adapter-loader", daemon=True)
        process.start()
        if self._cpus:  # a fresh interpreter, one thread so far; a respawn starts from any thread's mask
            os.sched_setaffinity(process.pid, self._cpus)
        child.close()
        worker = _Worker(process, parent)
        with self._lock:
            self._workers[process.pid] = worker
        return worker

    def wait_ready(self, timeout: float = _START_SECONDS) -> None:
        """Block until every idle process has started (imports done), so the first cold load does
        not pay for it; call before any load. RuntimeError if one does not start in time."""
        deadline = time.monotonic() + timeout
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            if not worker.ready:
                try:
                    self._await(worker, deadline, "(start-up)")
                except LoaderError as e:
                    raise RuntimeError(f"an adapter loader process did not start: {e.message}") from None
                worker.ready = True

    def busy_pids(self) -> list[int]:
        """The processes running a load now (tests kill one mid-load)."""
        with self._lock:
            return sorted(self._busy)

    def pids(self) -> list[int]:
        """Every loader process (benchmarks pin them to cores)."""
        with self._lock:
            return sorted(self._workers)

    def load(self, reference: str, policy: SourcePolicy, keys: S3Keys | None, shape: ModelShape,
             max_lora_rank: int) -> LoadedAdapter:
        """Fetch and validate in a loader process. Blocking: call it off the event loop. Raises
        SourceError (the source's refusal or failure), AdapterFormatError (the adapter is invalid)
        or LoaderError."""
        job = {"job": "fetch", "reference": reference, "policy": policy_to_json(policy), "shape": shape.__dict__,
               "max_lora_rank": max_lora_rank,
               "s3_keys": None if keys is None else {"access_key_id": keys.access_key_id,
                                                     "secret_access_key": keys.secret_access_key,
                                                     "session_token": keys.session_token}}
        return self._run(job, (), policy.timeout_seconds + self._validation_seconds, reference[:200], _loaded)

    def parse(self, config_json: bytes, weights: bytes, shape: ModelShape, max_lora_rank: int,
              what: str) -> LoraAdapter:
        """A stored adapter's files parsed and value-checked as adapters.format.load_adapter_bytes does
        (the engine's page-in from Redis), in a loader process; the same errors as `load`."""
        job = {"job": "parse", "shape": shape.__dict__, "max_lora_rank": max_lora_rank}
        return self._run(job, (config_json, weights), self._validation_seconds, what, _parsed)

    def _run(self, job: dict, blobs: tuple[bytes, ...], budget_seconds: float, what: str,
             result: Callable[[dict, list[bytes]], T | None]) -> T:
        deadline = time.monotonic() + budget_seconds
        try:
            worker = self._idle.get(timeout=budget_seconds)
        except queue.Empty:
            raise LoaderError(504, f"loading {what!r}: no adapter loader process came free in time",
                              "adapter_load_timeout") from None
        pid = worker.process.pid
        with self._lock:
            self._busy.add(pid)
        try:
            if not worker.ready:
                self._await(worker, time.monotonic() + _START_SECONDS, what)
                worker.ready = True
            try:
                send(worker.conn, job, blobs)
            except OSError:  # it died while idle (the OOM killer, kill -9): the pipe is broken
                raise self._died(worker, what) from None
            header, replies = self._await(worker, deadline, what)
            try:
                out = result(header, replies)
            except (ValueError, TypeError, KeyError):
                raise _out_of_bounds(what) from None
        except BaseException:
            self._replace(worker)
            raise
        finally:
            with self._lock:
                self._busy.discard(pid)
        self._idle.put(worker)
        if out is None:
            raise _refusal(header)
        return out

    def _await(self, worker: _Worker, deadline: float, what: str) -> tuple[dict, list[bytes]]:
        conn = worker.conn
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise LoaderError(504, f"loading {what!r} took longer than its time budget; the loader process "
                                       "was stopped", "adapter_load_timeout")
            return receive(conn, self._max_bytes)
        except (EOFError, ConnectionError):
            raise self._died(worker, what) from None
        except (OSError, ValueError):
            raise _out_of_bounds(what) from None

    @staticmethod
    def _died(worker: _Worker, what: str) -> LoaderError:
        worker.process.join(2.0)
        code = worker.process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return LoaderError(502, f"the adapter loader process died while loading {what!r} ({how}); this load "
                                "failed, the next one gets a new process", "adapter_loader_crashed")

    def _replace(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5.0)
        worker.conn.close()
        with self._lock:
            self._workers.pop(worker.process.pid, None)
            if self._closed:
                return
            self.restarts += 1
        self._idle.put(self._spawn())

    def close(self) -> None:
        """Stop every loader process (the server's shutdown); loads still running fail."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
            self._workers.clear()
        for w in workers:
            w.conn.close()  # the loop reads EOF and returns
        for w in workers:
            w.process.join(2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(2.0)


def _out_of_bounds(what: str) -> LoaderError:
    return LoaderError(502, f"the adapter loader process answered out of bounds while loading {what!r}; it was "
                            "stopped", "adapter_loader_failed")


def _loaded(header: dict, blobs: list[bytes]) -> LoadedAdapter | None:
    """The loaded adapter of a successful reply, None for a refusal; ValueError for a malformed one."""
    if header.get("ok") is not True:
        return None
    rank, modules, size, sha, parts = (header.get(k) for k in ("rank", "target_modules", "size_bytes", "sha256",
                                                                 "parts"))
    known = {p.name for p in OPTIONAL_PARTS}
    if not (isinstance(parts, list) and all(p in known for p in parts) and len(set(parts)) == len(parts)
            and len(blobs) == 2 + 2 * len(parts) and isinstance(rank, int) and isinstance(size, int)
            and isinstance(sha, str) and isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise ValueError("malformed loader reply")
    files = {p: (blobs[2 + 2 * i], blobs[3 + 2 * i]) for i, p in enumerate(parts)}
    return LoadedAdapter(AdapterSummary(rank, tuple(modules), size, blobs[0]), blobs[1], sha, **files)


def _parsed(header: dict, blobs: list[bytes]) -> LoraAdapter | None:
    """The adapter of a successful parse reply, its tensors views of one float32 buffer; None for a
    refusal; ValueError (TypeError, KeyError) for a malformed one."""
    if header.get("ok") is not True:
        return None
    config_json, data = blobs
    flat = torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.zeros(0)  # [sum numel]
    weights, at = {}, 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal at
        n = math.prod(shape)
        if n <= 0 or at + n > flat.numel():
            raise ValueError("tensor out of the buffer")
        at += n
        return flat[at - n: at].view(*shape)

    for layer, proj, rank, in_f, out_f, scaling, dora in header["modules"]:
        a, b = take(rank, in_f), take(out_f, rank)        # a: [r, in], b: [out, r]
        magnitude = take(out_f) if dora else None         # magnitude: [out]
        weights[(int(layer), str(proj))] = LoraWeights(a, b, float(scaling), magnitude)
    vocab = from_wire(header.get("vocab") or [], take)
    if at != flat.numel():
        raise ValueError("buffer longer than its tensors")
    return LoraAdapter(int(header["rank"]), tuple(header["target_modules"]), bool(header["use_rslora"]),
                       MappingProxyType(weights), int(header["size_bytes"]), json.loads(config_json), vocab=vocab)


def _refusal(header: dict) -> Exception:
    if header.get("kind") == "format":
        param = header.get("param")
        return AdapterFormatError(str(header.get("message")), param if isinstance(param, str) else None)
    status = header.get("status")
    if status not in (400, 403, 404, 413, 502, 504):
        status = 502
    return SourceError(status, str(header.get("message")), str(header.get("code") or "source_error"))
