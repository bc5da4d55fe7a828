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

import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from adapters.format import MAX_CONFIG_BYTES, AdapterFormatError, AdapterSummary, ModelShape
from adapters.loader_worker import receive, send, policy_to_json, serve
from adapters.sources import SourceError, SourcePolicy
from adapters.sources.s3_fetch import S3Keys

# A worker imports torch, safetensors and boto3 before it is ready; a loaded 2-core machine takes seconds.
_START_SECONDS = 120.0


class LoaderError(SourceError):
    """The loader process failed this load (died, overran its budget, answered nonsense): 502 or 504."""


@dataclass(frozen=True)
class LoadedAdapter:
    summary: AdapterSummary      # from the loader's full validation; canonical_config_json is what to store
    weights: bytes               # adapter_model.safetensors as fetched
    sha256: str                  # content hash of the fetched files (adapters.sources.AdapterFiles.sha256)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False


class LoaderPool:
    def __init__(self, workers: int, validation_seconds: float = 60.0) -> None:
        assert workers >= 1
        assert validation_seconds > 0
        self._ctx = multiprocessing.get_context("spawn")
        self._validation_seconds = validation_seconds
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
        process = self._ctx.Process(target=serve, args=(child,), name="loraplex-adapter-loader", daemon=True)
        process.start()
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
                    self._await(worker, deadline, "(start-up)", 0)
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
        deadline = time.monotonic() + policy.timeout_seconds + self._validation_seconds
        what = reference[:200]
        try:
            worker = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise LoaderError(504, f"loading {what!r}: no adapter loader process came free in time",
                              "adapter_load_timeout") from None
        job = {"reference": reference, "policy": policy_to_json(policy), "shape": shape.__dict__,
               "max_lora_rank": max_lora_rank,
               "s3_keys": None if keys is None else {"access_key_id": keys.access_key_id,
                                                     "secret_access_key": keys.secret_access_key,
                                                     "session_token": keys.session_token}}
        pid = worker.process.pid
        with self._lock:
            self._busy.add(pid)
        try:
            if not worker.ready:
                self._await(worker, time.monotonic() + _START_SECONDS, what, 0)
                worker.ready = True
            send(worker.conn, job)
            header, blobs = self._await(worker, deadline, what, policy.max_file_bytes + 4 * MAX_CONFIG_BYTES)
            try:
                loaded = _loaded(header, blobs)
            except ValueError:
                raise _out_of_bounds(what) from None
        except BaseException:
            self._replace(worker)
            raise
        finally:
            with self._lock:
                self._busy.discard(pid)
        self._idle.put(worker)
        if loaded is None:
            raise _refusal(header)
        return loaded

    def _await(self, worker: _Worker, deadline: float, what: str, max_blob: int) -> tuple[dict, list[bytes]]:
        conn = worker.conn
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise LoaderError(504, f"loading {what!r} took longer than its time budget; the loader process "
                                       "was stopped", "adapter_load_timeout")
            return receive(conn, max_blob)
        except (EOFError, ConnectionError):
            worker.process.join(2.0)
            code = worker.process.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            raise LoaderError(502, f"the adapter loader process died while loading {what!r} ({how}); "
                                   "this load failed, the next one gets a new process",
                              "adapter_loader_crashed") from None
        except (OSError, ValueError):
            raise _out_of_bounds(what) from None

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
    rank, modules, size, sha = (header.get(k) for k in ("rank", "target_modules", "size_bytes", "sha256"))
    if not (len(blobs) == 2 and isinstance(rank, int) and isinstance(size, int) and isinstance(sha, str)
            and isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise ValueError("malformed loader reply")
    return LoadedAdapter(AdapterSummary(rank, tuple(modules), size, blobs[0]), blobs[1], sha)


def _refusal(header: dict) -> Exception:
    if header.get("kind") == "format":
        param = header.get("param")
        return AdapterFormatError(str(header.get("message")), param if isinstance(param, str) else None)
    status = header.get("status")
    if status not in (400, 403, 404, 413, 502, 504):
        status = 502
    return SourceError(status, str(header.get("message")), str(header.get("code") or "source_error"))
