"""DoRA scales kept with the adapter version in its store (Redis), keyed by the base weights as served.

A DoRA adapter's per-output scales g = m / ||W + s B A|| (server.engine.lora.dora_scales) cost a W A^T over
every targeted projection: most of a DoRA load. They depend on the immutable adapter version and on W as
this process serves it, so once computed they are written to the adapter's store under (version, base
identity), and a later load of the version (after the host tier evicted it, on another replica, after a
restart) reads them instead.

The base identity is a sha256 of the served weights' bytes (each fused projection the scales are
computed against, after dtype casting and quantization, with its dtype, layout and shape): anything
that changes W as served changes it, and replicas serving the same bytes share it. It is computed once
per process, at engine start-up where the store is used (`prime`, server.engine.lora.dora_precompute), else by
the first use, layers hashed on up to IDENTITY_THREADS threads (hashlib releases the GIL): about 0.4 s of
one core per GB of weights.

What is read is checked (length, finite values) and computed afresh when missing or refused; the store
failing is never a failed load. The engine does not import redis: the store is any object with
`get(version, base) -> bytes | None` and `put(version, base, data) -> bool` (adapters.dora_scale_store).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.fp8_weights import Fp8Weight
from kernels.int4_weights import Int4Weight
from kernels.int8_weights import Int8Weight

log = logging.getLogger(__name__)

# Threads that hash the served weights' layers at once (the host's cores permitting).
IDENTITY_THREADS = 4


class ScaleStore(Protocol):
    def get(self, version: str, base: str) -> bytes | None: ...

    def put(self, version: str, base: str, data: bytes) -> bool: ...


@dataclass
class DoraScaleStats:
    computed: int = 0  # adapters whose scales were computed against the base weights
    precomputed: int = 0  # of those, computed when the version was accepted (server.engine.lora.dora_precompute)
    precompute_skipped: int = 0  # versions accepted while MAX_PENDING others waited: their first load computes
    read: int = 0  # loads whose scales came from the store
    refused: int = 0  # stored scales ignored (wrong length, non-finite values), computed instead
    stored: int = 0  # computed scales written to the store
    store_errors: int = 0  # store reads or writes that failed (the load went on without them)
    base_identity_ms: int = 0  # time the served weights' identity took (once per process)


class DoraScaleCache:
    """`store`: where scales outlive the host tier (None: nowhere, every load computes them);
    `weights`: per layer, group -> the fused weight the scales are computed against (DoraScales.weights)."""

    def __init__(self, store: ScaleStore | None, weights: list[dict]) -> None:
        self.store = store
        self.weights = weights
        self.stats = DoraScaleStats()
        self._lock = threading.Lock()  # loads run on the host tier's loader threads
        self._base_lock = threading.Lock()  # held while the identity is computed, by the one thread doing it
        self._base: str | None = None

    @property
    def known_base(self) -> str | None:
        """The identity if computed already (never computes it)."""
        return self._base

    @property
    def base(self) -> str:
        """The served weights' identity (hex sha256), computed at first use."""
        with self._base_lock:
            if self._base is None:
                start = time.perf_counter()
                self._base = served_weights_identity(self.weights)
                self.stats.base_identity_ms = round(1e3 * (time.perf_counter() - start))
                log.info("served weights' identity for DoRA scales: %s, in %d ms", self._base[:16],
                         self.stats.base_identity_ms)
            return self._base

    def prime(self) -> str:
        """The base identity, computed now (engine start-up) so that no load waits for it."""
        return self.base

    def read(self, version: str, numel: int, count_read: bool = True) -> torch.Tensor | None:
        """`version`'s stored scales, [numel] float32, or None when there are none that pass the checks.
        `count_read`: count a hit as a load's read (False: a check whether they are there)."""
        if self.store is None:
            return None
        try:
            data = self.store.get(version, self.base)
        except Exception as exc:  # noqa: BLE001 - a store outage costs a computation, not the load
            self.count("store_errors")
            log.warning("reading DoRA scales of %s failed (%r): computing them", version, exc)
            return None
        if data is None:
            return None
        scales = torch.frombuffer(bytearray(data), dtype=torch.float32) if len(data) % 4 == 0 else None
        if scales is None or scales.numel() != numel or not bool(torch.isfinite(scales).all()):
            self.count("refused")
            log.warning("stored DoRA scales of %s are %d bytes or not finite (want %d float32): computing them",
                        version, len(data), numel)
            return None
        if count_read:
            self.count("read")
        return scales

    def write(self, version: str, scales: torch.Tensor) -> None:
        """Keep `version`'s freshly computed scales ([n] float32, on the CPU) in the store."""
        self.count("computed")
        if self.store is None:
            return
        try:
            if self.store.put(version, self.base, scales.contiguous().numpy().tobytes()):
                self.count("stored")
        except Exception as exc:  # noqa: BLE001 - the scales serve from the host tier all the same
            self.count("store_errors")
            log.warning("storing DoRA scales of %s failed (%r)", version, exc)

    def count(self, field: str) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + 1)


def served_weights_identity(weights: list[dict]) -> str:
    """sha256 over each layer's sha256 of its served fused weights' bytes, dtype, layout and shape."""
    threads = max(1, min(IDENTITY_THREADS, os.cpu_count() or 1, len(weights)))
    with ThreadPoolExecutor(threads, thread_name_prefix="dora-base-identity") as pool:
        layers = list(pool.map(_layer_digest, range(len(weights)), weights))
    return hashlib.sha256(f"dora-base-v1 {sys.byteorder}".encode() + b"".join(layers)).hexdigest()


def _layer_digest(layer: int, groups: dict) -> bytes:
    digest = hashlib.sha256()
    for group in sorted(groups):
        weight = groups[group]
        if isinstance(weight, Int4Weight):
            parts, kind = [weight.qweight, weight.scale, weight.offset], f"Int4Weight/{weight.group_size}"
        elif isinstance(weight, (Int8Weight, Fp8Weight)):
            parts, kind = [weight.qweight, weight.scale], type(weight).__name__
        else:
            parts, kind = [weight], type(weight).__name__
        for t in parts:
            digest.update(f"{layer} {group} {kind} {t.dtype} {tuple(t.shape)}".encode())
            # hashlib releases the GIL on large buffers: the engine's step loop runs meanwhile.
            digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())
    return digest.digest()
